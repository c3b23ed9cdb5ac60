"""Generation in segments (`generate_in_segments`) against a scripted engine: the budget and seed of each segment,
the prompt a continued completion is sent with, where a completion ends (a stop, the engine's own limit, a stop token
drawn as a segment's last token, the token budget), and the weights' tag on every token."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from lit_rlvr.config.settings import RolloutConfig
from lit_rlvr.rollout.engine import Completion, RolloutEngine, SamplingParams
from lit_rlvr.rollout.segments import SegmentedPushes, generate_in_segments, segment_seed
from lit_rlvr.rollout.source import async_refusals

EOS = 99


@dataclass
class Scripted:
    """Completion r's j-th token overall is `script[r][j]`; row r belongs to the prompt `[groups[r]]` (default r),
    and a continued request is matched to the row by its tokens so far; a row ends with "stop" where its script
    ends; `limit` cuts every call short, as an engine's context would."""

    script: dict[int, list[int]]
    limit: int = 10_000
    groups: dict[int, int] = None

    def __post_init__(self):
        self.calls = []

    def __call__(self, prompts, counts, params):
        self.calls.append(([list(p) for p in prompts], list(counts), params.max_new_tokens, params.seed))
        out = []
        for prompt, n in zip(prompts, counts):
            per_prompt = []
            for k in range(n):
                done = len(prompt) - 1  # prompts are one token: the rest is the completion so far
                row = [r for r in sorted(self.script) if (self.groups or {}).get(r, r) == prompt[0]
                       and self.script[r][:done] == list(prompt[1:])][k]
                script = self.script[row]
                take = min(params.max_new_tokens, len(script) - done, self.limit)
                tokens = script[done:done + take]
                reason = "stop" if done + take == len(script) and take < params.max_new_tokens else "length"
                per_prompt.append(Completion(torch.tensor(tokens, dtype=torch.long),
                                             -torch.arange(1, take + 1, dtype=torch.float32), reason))
            out.append(per_prompt)
        return out


def tags():
    calls = []

    def between():
        calls.append(len(calls) + 10)
        return calls[-1]

    return between, calls


def test_segments_budget_seed_and_tags():
    engine = Scripted({0: list(range(1, 20))})
    between, landed = tags()
    params = SamplingParams(max_new_tokens=7, seed=5)
    (completion,), = generate_in_segments(engine, [[0]], [1], params, 3, between, eos_id=EOS)
    assert [c[2] for c in engine.calls] == [3, 3, 1]  # the last segment takes what is left of the budget
    assert [c[3] for c in engine.calls] == [5, segment_seed(5, 1), segment_seed(5, 2)]
    assert completion.token_ids.tolist() == list(range(1, 8)) and completion.finish_reason == "length"
    assert completion.versions.tolist() == [10, 10, 10, 11, 11, 11, 12] and landed == [10, 11, 12]
    assert completion.logprobs.tolist() == [-1, -2, -3, -1, -2, -3, -1]  # each segment's own log-probs
    assert engine.calls[1][0] == [[0, 1, 2, 3]] and engine.calls[2][0] == [[0, 1, 2, 3, 4, 5, 6]]


def test_segment_seeds():
    assert segment_seed(7, 0) == 7
    seeds = {segment_seed(7, k) for k in range(1, 50)} | {segment_seed(8, 1)}
    assert len(seeds) == 50 and 7 not in seeds and segment_seed(7, 3) == segment_seed(7, 3)
    assert all(0 <= s < 2 ** 56 for s in seeds)


def test_only_unfinished_completions_continue_in_their_groups():
    # prompt [0] has 2 completions (rows 0 and 1), prompt [2] one (row 2)
    engine = Scripted({0: [1, 2], 1: [5, 6, 7, 8, 9], 2: [3, 4, 5, 6, 7, 8, 9, 10]}, groups={1: 0})
    out = generate_in_segments(engine, [[0], [2]], [2, 1], SamplingParams(max_new_tokens=6), 2, tags()[0], EOS)
    assert [len(group) for group in out] == [2, 1]
    assert [c.token_ids.tolist() for group in out for c in group] == [[1, 2], [5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8]]
    assert [c.finish_reason for group in out for c in group] == ["stop", "stop", "length"]
    # row 0 filled its first segment exactly: it goes on, and its second call stops with no new token
    assert engine.calls[0][:2] == ([[0], [2]], [2, 1])
    assert engine.calls[1][1] == [1, 1, 1]


def test_a_stop_token_that_ends_a_segment_is_a_stop():
    engine = Scripted({0: [1, EOS, 3, 4], 1: [1, 2, 3, 4]})
    out = generate_in_segments(engine, [[0], [1]], [1, 1], SamplingParams(max_new_tokens=4, stop_token_ids=(2,)), 2,
                               tags()[0], EOS)
    assert [c.token_ids.tolist() for (c,) in out] == [[1, EOS], [1, 2]]
    assert [c.finish_reason for (c,) in out] == ["stop", "stop"] and len(engine.calls) == 1
    ignoring = Scripted({0: [1, EOS, 3, 4]})
    (c,), = generate_in_segments(ignoring, [[0]], [1], SamplingParams(max_new_tokens=4, ignore_eos=True), 2,
                                 tags()[0], EOS)
    assert c.token_ids.tolist() == [1, EOS, 3, 4] and len(ignoring.calls) == 2
    no_eos = Scripted({0: [1, EOS, 3, 4]})
    (c,), = generate_in_segments(no_eos, [[0]], [1], SamplingParams(max_new_tokens=4), 2, tags()[0], None)
    assert c.token_ids.tolist() == [1, EOS, 3, 4]  # no eos id given, no stop ids: a plain token


def test_a_completion_cut_short_by_the_engine_ends():
    engine = Scripted({0: list(range(1, 20))}, limit=2)  # the engine's own limit: 2 tokens a call
    (c,), = generate_in_segments(engine, [[0]], [1], SamplingParams(max_new_tokens=9), 3, tags()[0], EOS)
    assert c.token_ids.tolist() == [1, 2] and c.finish_reason == "length" and len(engine.calls) == 1


def test_one_segment_when_it_covers_the_budget():
    engine = Scripted({0: list(range(1, 20))})
    (c,), = generate_in_segments(engine, [[0]], [1], SamplingParams(max_new_tokens=4, seed=3), 4, tags()[0], EOS)
    assert engine.calls == [([[0]], [1], 4, 3)] and c.token_ids.tolist() == [1, 2, 3, 4]
    engine = Scripted({0: list(range(1, 20))})
    generate_in_segments(engine, [[0]], [1], SamplingParams(max_new_tokens=4), 9, tags()[0], EOS)
    assert [c[2] for c in engine.calls] == [4]


def test_a_segment_of_no_tokens_is_refused():
    with pytest.raises(ValueError, match="segment_tokens=0 must be at least 1"):
        generate_in_segments(Scripted({}), [[0]], [1], SamplingParams(), 0, tags()[0], EOS)
    (c,), = generate_in_segments(Scripted({0: [1, 2]}), [[0]], [1], SamplingParams(max_new_tokens=2), 1,
                                 tags()[0], EOS)
    assert c.token_ids.tolist() == [1, 2] and c.versions.tolist() == [10, 11]


def test_an_engine_that_answers_fewer_requests_than_it_was_sent_is_an_error():
    """A continued segment's answers are matched to its completions one by one: an engine that drops a request
    must not leave a completion silently cut at its last segment."""
    engine = Scripted({0: list(range(1, 20)), 1: list(range(1, 20))}, groups={1: 0})

    def drops_one(prompts, counts, params):
        out = engine(prompts, counts, params)
        return out[:-1] if len(engine.calls) > 1 else out

    with pytest.raises(ValueError):
        generate_in_segments(drops_one, [[0]], [2], SamplingParams(max_new_tokens=6), 3, tags()[0], EOS)


class StagingRecorder(SegmentedPushes, RolloutEngine):
    """A request-serving engine stand-in: `SegmentedPushes` staging, generation by `Scripted`, and a record of the
    loads and ends that reach it (values copied when they arrive) and of when each segment ran."""

    def __init__(self, scripted: Scripted, segment_tokens: int):
        self._init_segments(segment_tokens, EOS)
        self.scripted, self.events, self.on_call = scripted, [], None

    def load_weights(self, named_tensors):
        if self._staged_call("load_weights", named_tensors):
            return
        self.events.append(("load", [(n, t.clone()) for n, t in named_tensors]))

    def end_weight_update(self):
        if self._staged_call("end_weight_update"):
            return
        self.events.append(("end",))

    def _generate_once(self, prompts, counts, params):
        self.events.append(("segment",))
        out = self.scripted(prompts, counts, params)
        if self.on_call is not None:
            self.on_call(len(self.scripted.calls))
        return out

    def generate(self, prompt_token_ids, n_per_prompt, params):
        return self._generate_with_pushes(self._generate_once, prompt_token_ids, n_per_prompt, params)


def _from_another_thread(fn):
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_an_engine_that_generates_in_segments_swaps_in_flight():
    engine = StagingRecorder(Scripted({}), 2)
    assert async_refusals(RolloutConfig(mode="async", partial_rollout=True), engine=engine) == []


def test_a_push_made_while_segments_run_lands_between_them_with_the_values_it_was_given():
    """The trainer's thread pushes during the first segment and then goes on changing its tensors in place: the
    engine receives nothing until the segment ends, then the push's loads and end in order, with the values as
    they were when pushed (its own copies)."""
    engine = StagingRecorder(Scripted({0: list(range(1, 9))}), 2)

    def tag():
        with engine.push_in_flight(0):  # no generation under way: lands at once, a tag only
            pass

    _from_another_thread(tag)  # the trainer's thread pushes, the test's generates (as in the pipeline)
    weights = [("a", torch.zeros(3)), ("b", torch.ones(2))]

    def trainer():
        with engine.push_in_flight(1):
            engine.load_weights(weights)  # a list of (name, tensor) pairs, as one bucket of a push
            engine.load_weights(iter([("c", torch.full((2,), 5.0))]))  # an iterator of pairs
            engine.end_weight_update()
        for _, tensor in weights:
            tensor.add_(100.0)  # the optimizer's next step

    def push_during_first_segment(calls):
        if calls == 1:
            _from_another_thread(trainer)

    engine.on_call = push_during_first_segment
    (completion,), = engine.generate([[0]], [1], SamplingParams(max_new_tokens=4))
    assert completion.versions.tolist() == [0, 0, 1, 1]
    kinds = [e[0] for e in engine.events]
    assert kinds == ["segment", "load", "load", "end", "segment"]
    landed = {n: t.tolist() for e in engine.events if e[0] == "load" for n, t in e[1]}
    assert landed == {"a": [0.0, 0.0, 0.0], "b": [1.0, 1.0], "c": [5.0, 5.0]}
