"""Multi-turn rollouts through the rollout driver with the real HF engine (lit_rlvr/rollout/multi_turn.py):
token-exact sequences and masks, stop strings, limits, environments that raise or hang, weight sources, seeds."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from lit_rlvr.envs import Environment, TextEnv
from lit_rlvr.models.tiny import build_tiny, tiny_config
from lit_rlvr.rewards.base import RewardRunner
from lit_rlvr.rollout.batch import RolloutPlan
from lit_rlvr.rollout.driver import RolloutDriver
from lit_rlvr.rollout.engine import SamplingConfig
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.multi_turn import call_all, env_metrics, observation_text, stop_cut


class ScriptedEnv(TextEnv):
    """Observation `obs` after each turn; done after `steps` turns with reward 1 (`steps` None: never done).
    `fail` ("raise" | "hang") on the rollouts whose prompt contains `fail_on`."""

    def step(self, action: str):
        self.turns += 1
        cfg = self.env_config
        if cfg.get("fail") and cfg.get("fail_on", "") in self.prompt:
            if cfg["fail"] == "raise":
                raise RuntimeError("tool crashed")
            time.sleep(30)
        done = cfg.get("steps") is not None and self.turns >= cfg["steps"]
        return {"observations": "" if done else cfg.get("obs", "ab"), "reward": 1.0 if done else 0.0, "done": done,
                "metadata": {"tool_call": not done}}


def environment(stop=(), max_turns=4, max_tokens=64, timeout_s=10.0, **config) -> Environment:
    return Environment(make=lambda extras: ScriptedEnv(config, extras), stop=tuple(stop), max_turns=max_turns,
                       max_tokens=max_tokens, timeout_s=timeout_s, name="scripted")


def driver_for(model, tokenizer, env: Environment, max_new_tokens=8, engine=None) -> RolloutDriver:
    engine = engine or HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    return RolloutDriver(engine, tokenizer, RewardRunner(lambda p, c, a: 0.0), SamplingConfig(
        max_new_tokens=max_new_tokens), model, environment=env)


def plan_of(tokenizer, prompts, n=4, **kwargs) -> RolloutPlan:
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    return RolloutPlan(list(prompts), [0] * len(prompts), ids, [n] * len(prompts), **kwargs)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny(0)
    return model.eval(), tokenizer


def spy(engine):
    """Record every engine call (contexts, counts, params, completions)."""
    calls, generate = [], engine.generate

    def recorded(prompts, n, params):
        out = generate(prompts, n, params)
        calls.append(([list(p) for p in prompts], list(n), params, out))
        return out

    engine.generate = recorded
    return calls


def model_runs(mask_row):
    """[(start, end)] of the runs of True in a [T] bool row."""
    runs, start = [], None
    for t, m in enumerate(mask_row.tolist() + [False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


# -- token exactness ----------------------------------------------------------------------------------------------
def merging_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer that merges "a"+"b" into "ab": a sampled [a, b] decodes to "ab", which re-encodes to [ab]."""
    vocab = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3, "c": 4, "ab": 5, "=": 6}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def test_sampled_ids_are_the_trained_ids_where_re_encoding_changes_them():
    tokenizer = merging_tokenizer()
    assert tokenizer("ab", add_special_tokens=False)["input_ids"] == [5]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(len(tokenizer), hidden_size=32, layers=1, heads=2)).eval()
    driver = driver_for(model, tokenizer, environment(obs="cab", steps=3, max_tokens=40))
    calls = spy(driver.engine)
    rollouts = driver.rollout(plan_of(tokenizer, ["ab=", "c="], n=8), step=0, seed_key=(0,)).rollouts
    sampled = {}  # every turn the engine sampled: (context, ids) -> log-probs
    for contexts, _, _, out in calls:
        for context, per_prompt in zip(contexts, out):
            for c in per_prompt:
                sampled[tuple(context), tuple(c.token_ids.tolist())] = c.logprobs
    changed = 0
    obs_ids = tokenizer("cab", add_special_tokens=False)["input_ids"]
    for i in range(rollouts.num_samples):
        present = rollouts.response_attention_mask[i]
        mask = rollouts.response_mask[i]
        runs = model_runs(mask)
        assert len(runs) == len(rollouts.transcripts[i].turns[::2])  # one run per model turn
        prompt = rollouts.prompt_ids[i][rollouts.prompt_mask[i]].tolist()
        for start, end in runs:
            ids = rollouts.response_ids[i, start:end].tolist()
            key = (tuple(prompt + rollouts.response_ids[i, :start].tolist()), tuple(ids))
            assert key in sampled, "a trained token run is not what the engine sampled from that context"
            assert torch.equal(rollouts.old_logp[i, start:end], sampled[key].float())
            changed += tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids
        observed = rollouts.response_ids[i][present & ~mask].tolist()
        assert observed == obs_ids * (len(runs) - 1)  # the observations' own tokens, between the turns
        assert (rollouts.old_logp[i][present & ~mask] == 0).all()
    assert changed > 0, "no turn re-encodes differently: the test would not see re-tokenization"


def test_stop_strings_cut_turns_exactly_and_an_engine_that_runs_on_gives_the_same_transcripts(tiny):
    """HFEngine stops on the stop string's tokens; an engine without stop sequences runs on and the loop cuts the
    turn at the string: the same tokens, masks and transcripts, log-probs up to float rounding."""
    model, tokenizer = tiny
    env = environment(stop=("5",), obs="|", steps=3, max_tokens=48)
    stopping = driver_for(model, tokenizer, env, max_new_tokens=12)
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    generate = engine.generate
    engine.generate = lambda p, n, params: generate(p, n, replace(params, stop_sequences=()))
    running_on = driver_for(model, tokenizer, env, max_new_tokens=12, engine=engine)
    plan = plan_of(tokenizer, ["12+34=", "7*8="], n=8)
    a = stopping.rollout(plan, step=0, seed_key=(1,)).rollouts
    b = running_on.rollout(plan, step=0, seed_key=(1,)).rollouts
    assert [t.turns for t in a.transcripts] == [t.turns for t in b.transcripts]
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    # the decoding batches differ (rows leave them at other steps): equal up to float rounding
    torch.testing.assert_close(a.old_logp, b.old_logp, rtol=0, atol=1e-5)
    turns = [text for t in a.transcripts for role, text in t.turns if role == "assistant"]
    assert any(text.endswith("5") for text in turns), "no turn hit the stop string: the test would not see it"
    assert all("5" not in text[:-1] for text in turns)  # nothing after the first stop string


def test_stop_cut_finds_the_shortest_prefix():
    decode = "".join
    assert stop_cut(list("xx</c>yy"), ["</c>"], decode) == 6
    assert stop_cut(list("xx</c>"), ["</c>"], decode) == 6
    assert stop_cut(list("xxyy"), ["</c>"], decode) is None and stop_cut(list("ab"), [], decode) is None


# -- limits and failures --------------------------------------------------------------------------------------------
def test_turn_limit_cuts_the_rollout(tiny):
    model, tokenizer = tiny
    driver = driver_for(model, tokenizer, environment(steps=None, obs="|", max_turns=3, max_tokens=200))
    result = driver.rollout(plan_of(tokenizer, ["1+2="], n=4), step=0, seed_key=(0,))
    r = result.rollouts
    for i, t in enumerate(r.transcripts):
        assert [role for role, _ in t.turns] == ["assistant", "observation"] * 2 + ["assistant"]
        assert t.cut == "max_turns" and r.finish_reason[i] == "length"
    assert r.malformed.all() and (r.rewards == -1).all()
    assert env_metrics(r)["env/turns_mean"] == 3


def test_token_limit_cuts_the_rollout(tiny):
    model, tokenizer = tiny
    driver = driver_for(model, tokenizer, environment(steps=None, obs="0123456789", max_turns=50, max_tokens=30))
    r = driver.rollout(plan_of(tokenizer, ["1+2="], n=4), step=0, seed_key=(0,)).rollouts
    assert (r.response_attention_mask.sum(-1) <= 30).all()
    assert all(t.cut == "max_tokens" for t in r.transcripts) and r.malformed.all()


@pytest.mark.parametrize("fail", ["raise", "hang"])
def test_an_environment_that_raises_or_hangs_ends_only_its_rollouts(tiny, fail, caplog):
    model, tokenizer = tiny
    env = environment(steps=2, obs="|", fail=fail, fail_on="7", timeout_s=1.0)
    driver = driver_for(model, tokenizer, env)
    started = time.monotonic()
    r = driver.rollout(plan_of(tokenizer, ["1+2=", "7*8="], n=4), step=0, seed_key=(0,)).rollouts
    assert time.monotonic() - started < 20  # a hung step costs its timeout, not its 30 s
    failed = r.group == 1
    assert all((t.error is not None) == bool(f) for t, f in zip(r.transcripts, failed))
    assert ("hung" if fail == "hang" else "RuntimeError") in r.transcripts[int(failed.nonzero()[0])].error
    assert not r.response_mask[failed].any() and r.response_attention_mask[failed].any()  # kept, not trained on
    assert r.malformed[failed].all() and (r.rewards[failed] == -1).all()
    assert (r.rewards[~failed] == 1).all() and r.response_mask[~failed].any(-1).all()
    assert env_metrics(r)["env/tool_errors"] == 4
    assert sum("later failures of this kind are not logged" in m for m in caplog.messages) == 1  # logged once


def test_call_all_runs_calls_at_once_and_bounds_them():
    started = time.monotonic()
    out = call_all([lambda: time.sleep(0.3) or 1 for _ in range(16)] + [lambda: 1 / 0, lambda: time.sleep(5)], 1.0)
    assert time.monotonic() - started < 2.5  # 16 sleeps of 0.3 s overlap; the hung call is left after 1 s
    assert [s for s, _ in out] == ["ok"] * 16 + ["error", "timeout"]


# -- weight sources, seeds, evaluation ----------------------------------------------------------------------------
def test_every_turn_of_a_weight_source_runs_inside_its_weight_context(tiny):
    """3PO: each weight sample's rollouts keep their weights through all their turns."""
    model, tokenizer = tiny
    weight = model.model.norm.weight
    base = weight.detach().clone()
    active = {"source": None}

    class Context:
        def __init__(self, source):
            self.source = source

        def __enter__(self):
            active["source"] = self.source
            with torch.no_grad():
                weight.add_(0.5 * (self.source + 1))

        def __exit__(self, *exc):
            with torch.no_grad():
                weight.copy_(base)
            active["source"] = None

    driver = driver_for(model, tokenizer, environment(steps=3, obs="|"))
    seen = []
    generate = driver.engine.generate

    def recorded(prompts, n, params):
        seen.append((active["source"], float(weight.detach().sum())))
        return generate(prompts, n, params)

    driver.engine.generate = recorded
    plan = plan_of(tokenizer, ["1+2=", "3+4="], n=4, num_weight_sources=2, weight_context=Context)
    r = driver.rollout(plan, step=0, seed_key=(0,)).rollouts
    assert [s for s, _ in seen] == [0, 0, 0, 1, 1, 1]  # three turns of source 0, then three of source 1
    assert len({w for s, w in seen if s == 0}) == 1 and len({w for s, w in seen if s == 1}) == 1
    assert sorted(r.source.tolist()) == [0] * 4 + [1] * 4


def test_later_turns_draw_with_their_own_seeds(tiny):
    model, tokenizer = tiny
    driver = driver_for(model, tokenizer, environment(steps=3, obs="|"))
    calls = spy(driver.engine)
    driver.rollout(plan_of(tokenizer, ["1+2="], n=4), step=0, seed_key=(0,))
    seeds = [params.seed for _, _, params, _ in calls]
    assert len(seeds) == 3 and len(set(seeds)) == 3


def test_evaluation_runs_the_environment(tiny):
    model, tokenizer = tiny
    driver = driver_for(model, tokenizer, environment(steps=2, obs="|"))
    calls = spy(driver.engine)
    correct = driver.evaluate(plan_of(tokenizer, ["1+2=", "3+4="], n=1), 2, step=0, seed=0)
    assert correct.shape == (2, 2) and correct.all() and len(calls) == 2


def test_single_turn_batches_have_equal_masks(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    driver = RolloutDriver(engine, tokenizer, RewardRunner(lambda p, c, a: 0.0), SamplingConfig(max_new_tokens=6),
                           model)
    r = driver.rollout(plan_of(tokenizer, ["1+2="], n=4), step=0, seed_key=(0,)).rollouts
    assert torch.equal(r.response_mask, r.response_attention_mask) and r.transcripts == []
    assert env_metrics(r) == {}


# -- observations as chat messages ----------------------------------------------------------------------------------
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_messages_render_as_the_chat_template_continues_an_assistant_turn(tiny):
    _, tokenizer = tiny
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>",
                                        eos_token="<eos>", chat_template=CHAT)
    messages = [{"role": "tool", "content": "4042"}, {"role": "tool", "content": "7"}]
    text = observation_text(messages, tokenizer, chat_template=True, last_token="<|im_end|>")
    assert text == "\n<|im_start|>tool\n4042<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut at a stop string did not write the end of its message: the template's closing comes first
    assert observation_text(messages, tokenizer, chat_template=True).startswith("<|im_end|>\n<|im_start|>tool")
    assert observation_text(messages, tokenizer, chat_template=False) == "40427"
    assert observation_text("text", tokenizer, chat_template=True) == "text"
