"""Multi-turn rollouts: the model and an environment take turns (docs/environments.md, docs/architecture.md §3).

Per turn, every unfinished rollout is generated in one engine call (turn 0 from the prompts, so a group shares its
prefill; later turns from prompt + every response token so far, as token ids), its turn cut after the
environment's first stop string, decoded and handed to its environment's `step`. The steps of all rollouts run at
once in threads, each bounded by `env.timeout_s`. The observation's tokens are appended with `token_mask` False
and log-prob 0; the sampled ids are kept as sampled, never re-tokenized from text. A rollout ends when its
environment says done, at `env.max_turns` model turns or `env.max_tokens` response tokens or the model's last
position (`context`: the prompt plus the response fill it) (cut: malformed, reward `fail_reward`, finish reason
"length"), or when its environment raises or hangs (malformed, reward `fail_reward`, no token trained on). Between
turns and engine calls a stop request past its grace period abandons the run (`lit_rlvr.run.stop`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from lit_rlvr.data.lengths import over_limit
from lit_rlvr.envs import Environment
from lit_rlvr.rewards.base import RewardContract, plain_result
from lit_rlvr.rollout.batch import Rollouts, Transcript
from lit_rlvr.rollout.engine import Completion, SamplingParams
from lit_rlvr.run.rng import seed_of
from lit_rlvr.run.stop import STOP

log = logging.getLogger(__name__)

Generate = Callable[[Sequence[Sequence[int]], Sequence[int], SamplingParams], list[list[Completion]]]
FAIL_REWARD = -1.0  # a rollout cut by a limit or ended by a failing environment (the built-in rewards' wrong)


@dataclass
class Episode:
    """One rollout in progress: its response tokens (model and observation), and what its environment said."""

    group: int  # the prompt it answers
    env: Any = None
    ids: list[int] = field(default_factory=list)  # [t] response token ids
    logprobs: list[float] = field(default_factory=list)  # [t] behaviour log-probs (0 at observation tokens)
    # [t] the tag of the weights that drew each token (an observation: its turn's), when the engine tags them
    versions: Optional[list[int]] = None
    sampled: list[bool] = field(default_factory=list)  # [t] True = sampled by the model
    reward: float = 0.0  # sum of the steps' rewards
    malformed: bool = False
    done: bool = False
    turns: int = 0  # model turns so far
    room: int = 0  # response tokens it may hold: env.max_tokens, or less where the prompt leaves less of the context
    limit: str = "max_tokens"  # the cut when `room` is reached ("context": the model's positions)
    last_text: str = ""  # the last model turn, decoded
    transcript: Transcript = field(default_factory=Transcript)

    def end(self, *, malformed: bool = False, cut: Optional[str] = None, error: Optional[str] = None) -> None:
        self.done = True
        self.malformed = self.malformed or malformed or cut is not None or error is not None
        self.transcript.cut, self.transcript.error = cut, error
        if cut is not None or error is not None:
            self.reward = FAIL_REWARD

    @property
    def finish_reason(self) -> str:
        return "error" if self.transcript.error else "length" if self.transcript.cut else "stop"

    def completion(self) -> Completion:
        versions = self.versions if self.versions is not None and len(self.versions) == len(self.ids) else None
        return Completion(torch.tensor(self.ids, dtype=torch.long), torch.tensor(self.logprobs), self.finish_reason,
                          token_mask=torch.tensor(self.sampled, dtype=torch.bool),
                          versions=None if versions is None else torch.tensor(versions, dtype=torch.long))


STOP_POLL_S = 0.25  # seconds between stop checks while environment calls run


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[tuple[str, Any]]:
    """Run the calls at once, each in its own daemon thread, for at most `timeout_s` together; returns per call
    ("ok", value), ("error", exception) or ("timeout", None). A hung call's thread is left behind (a daemon: it
    cannot keep the process alive); nothing can stop a Python thread from outside."""
    results: list[tuple[str, Any]] = [("timeout", None)] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = ("ok", call())
        except BaseException as err:  # noqa: BLE001 - an environment's failure of any kind ends its rollout only
            results[i] = ("error", err)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"env-{i}") for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        # in short slices: a stop request past its grace must not wait for a call with a long timeout
        while t.is_alive() and (left := deadline - time.monotonic()) > 0:
            t.join(min(left, STOP_POLL_S))
            STOP.check()
    return results


def stop_cut(ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str]) -> Optional[int]:
    """The shortest prefix length of `ids` whose text contains one of `stops`, or None when the whole does not.

    Exact whatever the tokenization: a turn's tokens after the stop string are dropped, and the ones kept are the
    sampled ones with their log-probs (a causal model's earlier tokens do not depend on later ones)."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    if not any(s in decode(ids[:-1]) for s in stops):  # usual case: the engine stopped right after it
        return len(ids)
    low, high = 1, len(ids) - 1  # the answer is in [low, high]
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            high = mid
        else:
            low = mid + 1
    return low


_BASE = [{"role": "user", "content": "\x00u"}, {"role": "assistant", "content": "\x00a"}]


def observation_text(observations: Any, tokenizer: Any, *, chat_template: bool, last_token: str = "",
                     max_chars: Optional[int] = None) -> str:
    """The text an observation appends to the sequence (each text at most `max_chars` long: see `MultiTurn`).

    Text is appended as it is. Messages (SkyRL's form) are their contents joined, or, with the model's chat template,
    what the template writes after an assistant turn for them: the end of the assistant message the model did not
    write itself (`last_token`: its turn's last token, with special tokens, e.g. "<|im_end|>"), the messages, and
    the next assistant header, so consecutive tool messages render as the template renders them."""
    if isinstance(observations, str):
        return observations[:max_chars]
    messages = [{**m, "content": m["content"][:max_chars]} if isinstance(m.get("content"), str) else m
                for m in list(observations or [])]
    if not messages:
        return ""
    if not chat_template:
        return "".join(str(m.get("content", "")) for m in messages)
    before = tokenizer.apply_chat_template(_BASE, tokenize=False)
    after = tokenizer.apply_chat_template(_BASE + messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once messages follow: observations "
                         "cannot be appended as tokens")
    closing = before[before.rindex(_BASE[1]["content"]) + len(_BASE[1]["content"]):]  # e.g. "<|im_end|>\n"
    if last_token and closing.startswith(last_token):
        closing = closing[len(last_token):]
    return closing + after[len(before):]


class MultiTurn:
    """Runs an `Environment`'s rollouts with an engine's `generate` (see the module docstring)."""

    def __init__(self, environment: Environment, tokenizer: Any, *, chat_template: bool = False,
                 context: Optional[int] = None):
        self.environment, self.tokenizer, self.chat_template = environment, tokenizer, chat_template
        self.context = context  # the model's positions (None: unknown), which prompt + response must fit
        # the stop strings as token sequences: an engine that can stops on them (the cut above is exact anyway)
        self.stop_sequences = tuple(tuple(tokenizer(s, add_special_tokens=False)["input_ids"])
                                    for s in environment.stop)
        self.env_seconds = 0.0  # time spent waiting for environments (construction, steps), since the last read
        self._warned: set[str] = set()
        self._close_hung = False  # an environment's close() hung once: later closes are not waited for
        # a step's reward follows the reward functions' rule (finite, within the bound; else malformed, counted)
        self.contract = RewardContract(FAIL_REWARD, environment.score_bound)
        self.token_chars = longest_token(tokenizer)  # bounds an observation's text before it is tokenized

    def run(self, generate: Generate, prompt_token_ids: Sequence[Sequence[int]], prompts: Sequence[str],
            answers: Sequence[Any], counts: Sequence[int], params: SamplingParams) -> list[Episode]:
        """`counts[b]` rollouts of prompt b, prompt after prompt; every engine call goes through `generate`."""
        episodes = [Episode(b) for b, n in enumerate(counts) for _ in range(n)]
        self._start(episodes, prompts, answers)
        self._set_room(episodes, prompt_token_ids)
        turn = 0
        while active := [e for e in episodes if not e.done]:
            STOP.check()  # a stop request past its grace: an environment that is never done must not defer it
            remaining = max(e.room - len(e.ids) for e in active)
            turn_params = replace(params, seed=params.seed if turn == 0 else seed_of(params.seed, "turn", turn),
                                  max_new_tokens=max(1, min(params.max_new_tokens, remaining)),
                                  stop_sequences=self.stop_sequences)
            if turn == 0:  # from the prompts: a group shares its prefill, the engine keys samples by prompt
                per_prompt = [sum(e.group == b for e in active) for b in range(len(counts))]
                completions = [c for per in generate(prompt_token_ids, per_prompt, turn_params) for c in per]
            else:
                contexts = [[*prompt_token_ids[e.group], *e.ids] for e in active]
                completions = [c for per in generate(contexts, [1] * len(active), turn_params) for c in per]
            stepping = [e for e, c in zip(active, completions) if self._take_turn(e, c)]
            self._step(stepping)
            turn += 1
        self._close(episodes)
        self._warn_if_all_failed(episodes)
        return episodes

    # -- the parts of a turn ------------------------------------------------------------------------------------
    def _set_room(self, episodes: list[Episode], prompt_token_ids: Sequence[Sequence[int]]) -> None:
        """Each rollout's response budget: env.max_tokens, or what its prompt leaves of the context; a prompt that
        fills the context ends its rollouts before any turn."""
        for e in episodes:
            e.room = self.environment.max_tokens
            if self.context is not None and self.context - len(prompt_token_ids[e.group]) < e.room:
                e.room, e.limit = self.context - len(prompt_token_ids[e.group]), "context"
            if e.room < 1 and not e.done:
                e.end(cut="context")

    def _start(self, episodes: list[Episode], prompts: Sequence[str], answers: Sequence[Any]) -> None:
        env = self.environment

        def start(e: Episode) -> Any:
            # its own copy: an environment that edits its answer or extras cannot change the other rollouts'
            extras = copy.deepcopy({**env.extras, "prompt": prompts[e.group], "max_turns": env.max_turns,
                                    "reward_spec": {"method": "rule", "ground_truth": answers[e.group]}})
            instance = env.make(extras)
            messages = [{"role": "user", "content": prompts[e.group]}]
            first, _ = instance.init(messages)
            if first != messages and "init" not in self._warned:
                self._warned.add("init")
                log.warning("env=%s: init() returned another prompt; lit-rlvr generates from the data's prompt",
                            env.name)
            return instance

        for e, (status, value) in zip(episodes, self._timed_calls([lambda e=e: start(e) for e in episodes])):
            if status == "ok":
                e.env = value
            else:
                self._fail(e, status, value, "start")

    def _take_turn(self, e: Episode, c: Completion) -> bool:
        """Append the model's turn; True when the environment is to step on it (False: a limit cut the rollout)."""
        ids = c.token_ids.tolist()
        cut = stop_cut(ids, self.environment.stop, self._decode)
        ended = cut is not None or c.finish_reason == "stop"
        ids = ids[:cut] if cut is not None else ids
        room = e.room - len(e.ids)
        over = len(ids) >= room and not ended or len(ids) > room  # the token budget cut the turn
        ids = ids[:room]
        e.ids += ids
        e.logprobs += c.logprobs[: len(ids)].tolist()
        if c.versions is not None and len(e.versions or ()) == len(e.ids) - len(ids):  # every earlier token tagged
            e.versions = (e.versions or []) + c.versions[: len(ids)].tolist()
        else:
            e.versions = None
        e.sampled += [True] * len(ids)
        e.last_text = self._decode(ids)
        e.turns += 1
        e.transcript.turns.append(("assistant", e.last_text))
        if over:
            e.end(cut=e.limit)
            return False
        return True

    def _step(self, stepping: list[Episode]) -> None:
        env = self.environment
        outcomes = self._timed_calls([lambda e=e: plain_reward(e.env.step(e.last_text)) for e in stepping])
        started = time.perf_counter()  # reading the outputs is the environments' time too (time/env_s)
        for e, (status, out) in zip(stepping, outcomes):
            if status != "ok":
                self._fail(e, status, out, "step")
                continue
            try:
                done = bool(out.get("done"))
                metadata = out.get("metadata") or {}
                # more characters than the room left can hold as tokens end the rollout anyway: cut them before
                # the template and the tokenizer (a 1 MB observation costs what a fitting one does)
                room = (e.room - len(e.ids)) * self.token_chars + 1
                text = "" if done else observation_text(out.get("observations"), self.tokenizer,
                                                        chat_template=self.chat_template, max_chars=room,
                                                        last_token=self._decode(e.ids[-1:], special=True))[:room]
                # an observation longer than the room left (one token kept for the answer) cuts the rollout
                too_long = bool(text) and over_limit(text, self._tokenize, e.room - len(e.ids) - 1) is not None
                obs = self._tokenize(text) if text and not too_long else []
            except Exception as err:  # noqa: BLE001 - a malformed step output is the environment's failure
                self._fail(e, "error", err, "step output")
                continue
            result, broken = self.contract.check(out.get("reward", 0.0))  # no key: no reward at this step
            if broken:  # the rollout ends malformed with the failure score, as a reward function's would
                e.transcript.reward_error, e.reward, done = result.info, 0.0, True
            if broken or result.malformed:
                metadata = {**metadata, "malformed": True}
            e.reward += result.score
            e.transcript.tool_calls += int(bool(metadata.get("tool_call", not done)))
            if done:
                e.end(malformed=bool(metadata.get("malformed", False)))
            elif e.turns >= env.max_turns:
                e.end(cut="max_turns")
            elif too_long or len(e.ids) + len(obs) >= e.room:  # no room left for the model to answer
                e.end(cut=e.limit)
            else:
                e.ids += obs
                e.logprobs += [0.0] * len(obs)
                if e.versions:
                    e.versions += e.versions[-1:] * len(obs)
                e.sampled += [False] * len(obs)
                e.transcript.turns.append(("observation", text))
        self.env_seconds += time.perf_counter() - started

    def _close(self, episodes: list[Episode]) -> None:
        """Each environment's `close()`, counted when it raises or hangs (`env/close_failures`). Once one has hung,
        later closes run without being waited for: a slow close would cost `env.timeout_s` at every step."""
        closing = [e for e in episodes if e.env is not None and e.transcript.error is None]
        calls = [getattr(e.env, "close", lambda: None) for e in closing]
        if self._close_hung:
            call_all(calls, 0.0)  # started in daemon threads, not waited for
            return
        for e, (status, err) in zip(closing, self._timed_calls(calls)):
            if status == "ok":
                continue
            what = (f"hung (> env.timeout_s={self.environment.timeout_s:g}s)" if status == "timeout"
                    else f"raised {type(err).__name__}: {err}")
            e.transcript.close_error = what
            self._close_hung = self._close_hung or status == "timeout"
            if f"close:{status}" not in self._warned:
                self._warned.add(f"close:{status}")
                log.warning("env=%s close() %s: counted in env/close_failures (the rollout is kept)%s",
                            self.environment.name, what,
                            "; later closes are not waited for" if status == "timeout" else
                            "; later failures of this kind are not logged")

    def _timed_calls(self, calls: list[Callable[[], Any]]) -> list[tuple[str, Any]]:
        if not calls:
            return []
        started = time.perf_counter()
        try:
            return call_all(calls, self.environment.timeout_s)
        finally:
            self.env_seconds += time.perf_counter() - started

    def _warn_if_all_failed(self, episodes: list[Episode]) -> None:
        """Every rollout failed (its environment, or its reward): the step learns nothing; say so, naming the error,
        the first time (a run that trains on nothing must not look like one that trains)."""
        errors = [e.transcript.error or e.transcript.reward_error for e in episodes]
        if episodes and all(errors) and "all" not in self._warned:
            self._warned.add("all")
            log.warning("env=%s: every one of %d rollouts failed, so nothing is learned from them; the first: %s "
                        "(fix the environment or its options; later steps like this are not logged)",
                        self.environment.name, len(episodes), errors[0])

    def _fail(self, e: Episode, status: str, err: Any, where: str) -> None:
        """The environment raised or hung: the rollout ends malformed and masked; the first of each kind is logged."""
        what = (f"hung (> env.timeout_s={self.environment.timeout_s:g}s)" if status == "timeout"
                else f"raised {type(err).__name__}: {err}")
        e.end(error=f"{where} {what}")
        e.env = None if status == "timeout" else e.env  # a hung environment is left alone (not closed)
        kind = f"{where}:{status}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("env=%s %s %s: that rollout ends malformed and is not trained on (counted in env/tool_errors;"
                        " later failures of this kind are not logged)", self.environment.name, where, what,
                        exc_info=err if isinstance(err, BaseException) else None)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _decode(self, ids: list[int], special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)


def plain_reward(out: Any) -> Any:
    """A step's output with its reward made plain by the reward contract (`plain_result`) where the step ran, in
    its time bound: the trainer never calls into a returned object (docs/rewards.md)."""
    if isinstance(out, dict) and "reward" in out:
        out = {**out, "reward": plain_result(out["reward"])}
    return out


def longest_token(tokenizer: Any) -> int:
    """The most characters one token can stand for (its vocabulary's longest entry; byte-level entries are at least
    as long as their text): n tokens never hold more than n times it."""
    vocab = getattr(tokenizer, "get_vocab", lambda: {})()
    return 2 * max(map(len, vocab), default=64)  # twice: a normalizer may join characters (NFC)


def score_episodes(part: Rollouts, episodes: list[Episode], tokenizer: Any) -> None:
    """Fill a packed part's rewards, malformed flags, texts and transcripts from its episodes (in the same order);
    a rollout whose environment failed keeps its tokens in the sequence but none counts in the loss."""
    part.rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)  # [N]
    part.malformed = torch.tensor([e.malformed for e in episodes], dtype=torch.bool)  # [N]
    failed = torch.tensor([e.transcript.error is not None for e in episodes], dtype=torch.bool)  # [N]
    part.response_mask = part.response_mask & ~failed[:, None]  # [N, T]
    part.completions = [tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
    part.transcripts = [e.transcript for e in episodes]


def env_metrics(rollouts: Rollouts) -> dict[str, torch.Tensor]:
    """`env/*` metrics of a step's rollouts ({} for single-turn rollouts): model turns and tool calls per rollout,
    rollouts whose environment failed, and the share of response tokens that are observations."""
    if not rollouts.transcripts:
        return {}
    transcripts = rollouts.transcripts
    turns = torch.tensor([sum(role == "assistant" for role, _ in t.turns) for t in transcripts], dtype=torch.float32)
    ok = torch.tensor([t.error is None for t in transcripts])[:, None]  # [N, 1] failed rollouts train on nothing
    present = (rollouts.response_attention_mask & ok).sum()
    observed = (rollouts.response_attention_mask & ~rollouts.response_mask & ok).sum()
    return {
        "env/turns_mean": turns.mean(),
        "env/tool_calls_mean": torch.tensor([float(t.tool_calls) for t in transcripts]).mean(),
        "env/tool_errors": torch.tensor(float(sum(t.error is not None for t in transcripts))),
        "env/close_failures": torch.tensor(float(sum(t.close_error is not None for t in transcripts))),
        "env/cut_frac": torch.tensor([t.cut is not None for t in transcripts], dtype=torch.float32).mean(),
        "env/obs_token_frac": observed.float() / present.clamp_min(1).float(),
    }
