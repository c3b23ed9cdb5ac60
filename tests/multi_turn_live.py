"""Checks of multi-turn rollouts on a live engine (vLLM, SGLang) against HFEngine on the same policy, shared by
tests/test_vllm_live.py and tests/live_sglang/: greedy transcripts token for token, and sampled rollouts whose ids,
masks and log-probs agree with the policy's own forward over the whole sequence (observations attended to)."""

from __future__ import annotations

import torch

from lit_rlvr.envs import Environment, TextEnv
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.multi_turn import MultiTurn

PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4="]


class CountingEnv(TextEnv):
    """Answers each turn with its length in characters; done after 3 turns."""

    def step(self, action):
        self.turns += 1
        done = self.turns >= 3
        return {"observations": "" if done else f"[{len(action)}]", "reward": 1.0, "done": done, "metadata": {}}


def _run(generate, tokenizer, env, counts, params):
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return MultiTurn(env, tokenizer).run(generate, ids, PROMPTS, [0] * len(PROMPTS), counts, params), ids


def assert_greedy_transcripts_equal_hf(engine, model, tokenizer) -> None:
    hf = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    first = [c for g in hf.generate(ids, [1] * len(ids), greedy) for c in g]
    # a stop string greedy decoding reaches mid-turn: HF stops on it, the live engine runs on and is cut
    stop = next(tokenizer.decode(c.token_ids[1:2]) for c in first if len(c.token_ids) > 2)
    env = Environment(make=lambda extras: CountingEnv({}, extras), stop=(stop,), max_turns=3, max_tokens=40,
                      timeout_s=60.0)
    want, _ = _run(hf.generate, tokenizer, env, [1] * len(PROMPTS), greedy)
    got, _ = _run(engine.generate, tokenizer, env, [1] * len(PROMPTS), greedy)
    for w, g in zip(want, got):
        assert g.transcript.turns == w.transcript.turns
        assert g.ids == w.ids and g.sampled == w.sampled
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
    assert sum(len(e.transcript.turns) for e in want) > len(want)  # several turns
    assert any(text.endswith(stop) for e in want for role, text in e.transcript.turns if role == "assistant")


@torch.no_grad()
def assert_sampled_rollouts_are_consistent(engine, model, tokenizer) -> None:
    """T = 1, 3 rollouts per prompt (engines without per-request seeds on a CPU cannot be compared draw for draw):
    each rollout's sampled tokens carry the policy's log-probs given everything before them, observations
    included; observation tokens are the environment's text, tokenized."""
    env = Environment(make=lambda extras: CountingEnv({}, extras), max_turns=3, max_tokens=40, timeout_s=60.0)
    episodes, ids = _run(engine.generate, tokenizer, env, [3] * len(PROMPTS),
                         SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    for e in episodes:
        sequence = torch.tensor([list(ids[e.group]) + e.ids])  # [1, P + t]
        logits = model(input_ids=sequence).logits[0, len(ids[e.group]) - 1 : -1].float()  # [t, V]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(e.ids)[:, None])[:, 0]  # [t]
        sampled = torch.tensor(e.sampled)
        torch.testing.assert_close(torch.tensor(e.logprobs)[sampled], logp[sampled], rtol=0, atol=1e-4)
        assert (torch.tensor(e.logprobs)[~sampled] == 0).all()
        observed = [text for role, text in e.transcript.turns if role == "observation"]
        assert tokenizer.decode([t for t, s in zip(e.ids, e.sampled) if not s]) == "".join(observed)
