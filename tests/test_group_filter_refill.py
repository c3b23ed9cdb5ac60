"""DAPO's group filter (`GroupFilter.collect`) against a scripted generator: which groups it keeps and in what order,
the seed stream of each refill, where it stops (a full batch, the generation budget, the end of the data), and its
metrics counted by hand over every generated completion."""

from __future__ import annotations

import logging

import pytest
import torch

from lit_rlvr.algorithms import FilterGroups, GroupFilter
from lit_rlvr.algorithms.filter_groups import DataStream
from lit_rlvr.config.errors import GenerationBudgetError
from lit_rlvr.rollout.batch import Rollouts

# each prompt's rewards (2 completions): informative under `acc` when one is > 0 and the other is not
REWARDS = {
    "same0": [0.0, 0.0], "same1": [1.0, 1.0], "same2": [-1.0, -1.0], "same3": [0.0, 0.0],
    "mixA": [1.0, 0.0], "mixB": [0.5, -1.0], "mixC": [2.0, 0.0], "mixD": [1.0, -0.5],
    "scoreOnly": [0.5, 1.0],  # both correct: constant under acc, differs under score
    "single": [1.0],  # a group of one completion: never informative
}


def generate(batch, seeds) -> Rollouts:
    prompts = batch["prompt"]
    rewards = [r for p in prompts for r in REWARDS[p]]
    n, width = len(rewards), 3
    return Rollouts(
        prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
        response_ids=torch.full((n, width), len(generate.calls)), response_mask=torch.ones(n, width, dtype=torch.bool),
        old_logp=torch.zeros(n, width), group=torch.arange(n) // 2, source=torch.zeros(n, dtype=torch.long),
        num_groups=len(prompts), prompts=list(prompts), answers=[0] * len(prompts), rewards=torch.tensor(rewards),
        malformed=torch.zeros(n, dtype=torch.bool))


def collect(first, following, **options):
    generate.calls = []

    def rollout(batch, seeds):
        out = generate(batch, seeds)
        generate.calls.append((tuple(batch["prompt"]), seeds))
        return out

    stream = iter([{"prompt": list(b)} for b in following])
    return GroupFilter(FilterGroups(enable=True, **options), pad_token_id=0).collect(
        {"prompt": list(first)}, rollout, lambda: next(stream, None))


def generated_stats(batches):
    rewards = [r for b in batches for p in b for r in REWARDS[p]]
    return sum(r > 0 for r in rewards) / len(rewards), sum(rewards) / len(rewards)


def values(metrics):
    return {k: round(float(v), 6) for k, v in metrics.items()}


def test_a_full_first_batch_needs_no_refill():
    out, metrics = collect(["mixA", "mixB"], [["mixC", "mixD"]])
    assert out.prompts == ["mixA", "mixB"] and out.num_groups == 2
    assert generate.calls == [(("mixA", "mixB"), ())]  # the step's own seed stream
    accuracy, mean = generated_stats([["mixA", "mixB"]])
    assert values(metrics) == {"dapo/kept_groups": 2.0, "dapo/refill_rounds": 0.0, "dapo/cap_hit": 0.0,
                               "reward/accuracy_generated": round(accuracy, 6),
                               "reward/mean_generated": round(mean, 6)}


def test_refills_take_the_next_batches_groups_in_order_and_drop_the_surplus():
    first, following = ["same0", "mixA", "same1"], [["mixB", "same2", "same3"], ["same0", "same1", "same2"],
                                                   ["mixC", "mixD", "same0"], ["mixA", "mixA", "mixA"]]
    out, metrics = collect(first, following)
    # kept: mixA (batch 0), mixB (refill 1), none (refill 2), mixC (refill 3; mixD is the surplus)
    assert out.prompts == ["mixA", "mixB", "mixC"] and out.num_groups == 3
    assert out.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.rewards.tolist() == REWARDS["mixA"] + REWARDS["mixB"] + REWARDS["mixC"]
    # each refill samples from a seed stream of its own: (), (-1,), (-2,), (-3,)
    assert [seeds for _, seeds in generate.calls] == [(), (-1,), (-2,), (-3,)]
    accuracy, mean = generated_stats([first, *following[:3]])  # every generated completion, kept or not
    assert values(metrics) == {"dapo/kept_groups": 3.0, "dapo/refill_rounds": 3.0, "dapo/cap_hit": 0.0,
                               "reward/accuracy_generated": round(accuracy, 6),
                               "reward/mean_generated": round(mean, 6)}
    assert accuracy == 8 / 24 and mean == pytest.approx(3 / 24)


@pytest.mark.parametrize("metric, kept", [("acc", ["mixA"]), ("score", ["scoreOnly", "mixA"])])
def test_the_metric_decides_what_differs(metric, kept):
    out, metrics = collect(["scoreOnly", "mixA"], [], metric=metric)
    assert out.prompts == kept
    assert float(metrics["dapo/cap_hit"]) == float(len(kept) < 2)


def test_the_data_running_out_trains_on_the_groups_it_has():
    out, metrics = collect(["same0", "mixA", "same2"], [["same1", "mixB", "same3"]])
    assert out.prompts == ["mixA", "mixB"] and out.num_groups == 2
    assert values(metrics)["dapo/kept_groups"] == 2.0
    assert values(metrics)["dapo/refill_rounds"] == 1.0 and values(metrics)["dapo/cap_hit"] == 1.0


def test_no_informative_group_at_all_returns_the_last_batch():
    out, metrics = collect(["same0", "same1"], [["same2", "same3"]])
    assert out.prompts == ["same2", "same3"]  # every advantage is 0: the last batch as generated
    assert values(metrics)["dapo/kept_groups"] == 0.0 and values(metrics)["dapo/cap_hit"] == 1.0
    assert values(metrics)["dapo/refill_rounds"] == 1.0


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_the_generation_budget_counts_the_first_batch(budget):
    following = [["same1", "same2"], ["mixB", "mixC"]]
    if budget < 3:  # the third batch would fill it: the budget ends the run before
        with pytest.raises(GenerationBudgetError,
                           match=rf"max_num_gen_batches={budget}: {budget} generation batches gave 1 of 2 groups"):
            collect(["mixA", "same0"], following, max_num_gen_batches=budget)
        assert len(generate.calls) == budget
    else:  # exactly the budget: allowed
        out, metrics = collect(["mixA", "same0"], following, max_num_gen_batches=budget)
        assert out.prompts == ["mixA", "mixB"] and values(metrics)["dapo/refill_rounds"] == 2.0


def test_a_step_that_keeps_refilling_says_so_at_10_100_and_1000_batches(caplog):
    following = [["same0"]] * 1_002 + [["mixA"]]  # (10,000 refills: 20 s, left out)
    with caplog.at_level(logging.WARNING):
        out, metrics = collect(["same1"], following)
    assert out.prompts == ["mixA"] and values(metrics)["dapo/refill_rounds"] == 1_003.0
    lines = [r.getMessage() for r in caplog.records if "generation batches in this step" in r.getMessage()]
    assert [int(line.split(": ")[1].split()[0]) for line in lines] == [10, 100, 1000]


class Recording:
    def __init__(self):
        self.noted = 0

    def note_batches(self, n):
        self.noted += n


def test_the_data_stream_tells_the_datamodule_of_every_batch_it_hands_out():
    datamodule = Recording()
    stream = DataStream(iter([({"prompt": ["a"]}, 0, 0), ({"prompt": ["b"]}, 1, 0)]), datamodule)
    assert stream.first() == ({"prompt": ["a"]}, 0) and datamodule.noted == 1
    assert stream.next_batch() == {"prompt": ["b"]} and datamodule.noted == 2
    assert stream.next_batch() is None and datamodule.noted == 2  # ran out: nothing handed out
    assert DataStream(None, datamodule).next_batch() is None
    plain = DataStream(iter([({"prompt": ["a"]}, 0, 0)]), object())  # a datamodule without the hook
    assert plain.first() == ({"prompt": ["a"]}, 0)


def test_the_generated_metrics_of_a_single_completion():
    out, metrics = collect(["single"], [])
    assert out.prompts == ["single"]  # nothing informative, the data ran out: the batch as generated
    assert values(metrics)["reward/accuracy_generated"] == 1.0 and values(metrics)["reward/mean_generated"] == 1.0
