"""The parts `GRPOModule` hands its step's bookkeeping to: the data stream of a step that reads further batches,
the run's counters, the step's row of metrics."""

import torch

from lit_rlvr.algorithms.filter_groups import DataStream
from lit_rlvr.run.counters import RunCounters
from lit_rlvr.run.step_log import step_row
from lit_rlvr.run.step_timer import StepTimer


class Datamodule:
    def __init__(self):
        self.used = 0

    def note_batches(self, n):
        self.used += n


def test_data_stream_tells_the_datamodule_every_batch_it_hands_out():
    datamodule = Datamodule()
    stream = DataStream(iter([({"prompt": ["a"]}, 0, 0), ({"prompt": ["b"]}, 1, 0)]), datamodule)
    assert stream.first() == ({"prompt": ["a"]}, 0)
    assert stream.next_batch() == {"prompt": ["b"]}
    assert stream.next_batch() is None  # the epoch ran out: not counted
    assert datamodule.used == 2
    assert DataStream(None).next_batch() is None  # outside a fit: no further batches


def test_run_counters_restore_gives_the_summed_totals_to_rank_zero_only():
    saved = {**RunCounters(), "rollouts_total": 8, "tokens_generated": 40, "rl_steps": 2}
    rank0, rank1 = RunCounters(), RunCounters()
    rank0.restore(saved, rank=0)
    rank1.restore(saved, rank=1)
    assert (rank0["rollouts_total"], rank0["rl_steps"]) == (8, 2)
    assert (rank1["rollouts_total"], rank1["tokens_generated"], rank1["rl_steps"]) == (0, 0, 2)
    assert rank0.global_values() == dict(rank0)  # one process: the sum is its own


class Batch:
    rewards = torch.tensor([1.0, 0.0])
    malformed = torch.tensor([False, True])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    finish_reason = ["stop", "length"]

    def num_tokens(self):
        return 5


def test_step_row_counts_this_steps_rollouts_and_keeps_extra_metrics_last():
    counters = {**RunCounters(), "rollouts_total": 6}
    timer = StepTimer()
    timer.reset()
    row = step_row(Batch(), counters, 4, timer, 2.0, {"env/turns_mean": torch.tensor(1.0)})
    assert float(row["rollouts/per_step"]) == 2 and float(row["response/clip_frac"]) == 0.5
    assert float(row["perf/tokens_per_s"]) == 2.5 and list(row)[-1] == "env/turns_mean"
