"""FSDP2 with one colocated `copy`-mode HF engine per rank: 2 CPU processes over gloo, launched by torchrun.

The runs go through `train.py` itself (trainer=fsdp on CPU, fp32 compute) with `fsdp_checks.PushCheck`, which
records after every weight push whether each rank's engine holds exactly the gathered trainer weights.

Tolerance of the 2-rank vs 1-rank comparison: 1e-5 relative. The rollouts are identical (the engine's
sampling is keyed per prompt, not per batch or rank), but the sums behind the loss, the gradient and the
metrics are split differently (two half-batches whose gradients are averaged by a reduce-scatter, versus one
batch), so they differ in float32 rounding (measured: ≤ 1e-6 relative over 3 steps).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
COMMON = ["engine.options.mode=copy", "data.batch_size=8", "data.num_test=16",
          "eval_before=false", "callbacks.progress=null", "+callbacks.push_check._target_=fsdp_checks.PushCheck"]
FSDP_CPU = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy.param_dtype=float32"]
TIMING = ("time/", "perf/")
# V0.5 with its prior present from the second step on (each rank adds 4 records per step)
V05 = ["algorithm=v05", "algorithm.callbacks.value_prior.min_context=4", "algorithm.callbacks.value_prior.k_max=8"]
ASYNC = ["rollout.mode=async"]


def _run(run_dir: Path, overrides: list[str], ranks: int, steps: int = 3, push_check: bool = True) -> Path:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    # --standalone: torchrun picks a free rendezvous port itself (no race between choosing a port and binding it)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}"] if ranks > 1 else [sys.executable]
    common = [o for o in COMMON if o.split("=")[0] not in {o.split("=")[0] for o in overrides}]  # overrides win
    checks = [f"+callbacks.push_check.out_dir={run_dir}"] if push_check else []
    if not push_check:
        common = [o for o in common if "push_check" not in o]
    cmd = [*launcher, "train.py", *common, *overrides, f"trainer.max_steps={steps}", *checks,
           f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return run_dir


def _rows(run_dir: Path) -> list[dict[str, float]]:
    with (run_dir / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("reward/mean")]
    # NaN (e.g. V0.5's prior metrics while the prior is absent) as None, so equal rows compare equal
    return [{k: None if v == "nan" else float(v) for k, v in r.items() if v != "" and not k.startswith(TIMING)}
            for r in rows]


def _pushes(run_dir: Path, rank: int) -> list[dict]:
    return json.loads((run_dir / f"push_check_rank{rank}.json").read_text())


def _side_by_side(runs: dict[str, Callable[[], Path]]) -> dict[str, Path]:
    """Each of `runs` called, two at a time: a rank spends much of a run importing or waiting on the other rank,
    so two runs (4 processes) keep CI's 2 cores busier than one (measured: 2 C3PO runs in 47 s side by side, 30 s
    each alone)."""
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run) for name, run in runs.items()}
    return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    grpo = ["algorithm.group_size=4"]
    return _side_by_side({
        "two_ranks": partial(_run, base / "two_ranks", FSDP_CPU + grpo, ranks=2),
        "two_ranks_1kb_buckets": partial(_run, base / "small_buckets",
                                         FSDP_CPU + grpo + ["+engine.options.bucket_bytes=1024"], ranks=2),
        "one_rank": partial(_run, base / "one_rank", grpo, ranks=1),
        "c3po_two_ranks": partial(_run, base / "c3po", FSDP_CPU + ["algorithm=c3po"], ranks=2),
        "v05_two_ranks": partial(_run, base / "v05", FSDP_CPU + V05, ranks=2),
        "c3po_lora_two_ranks": partial(_run, base / "c3po_lora", FSDP_CPU + ["algorithm=c3po", "model.lora.rank=4"],
                                       ranks=2),
        "v05_async0_two_ranks": partial(_run, base / "v05_async0",
                                        FSDP_CPU + V05 + ASYNC + ["rollout.max_staleness=0"], ranks=2),
        "c3po_async0_two_ranks": partial(_run, base / "c3po_async0",
                                         FSDP_CPU + ["algorithm=c3po"] + ASYNC + ["rollout.max_staleness=0"], ranks=2),
    })


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory):
    """The C3PO and the V0.5 runs stopped after 2 steps, then resumed from their last.ckpt for the third."""
    base = tmp_path_factory.mktemp("fsdp")
    firsts = {"c3po": (base / "c3po_resumed", FSDP_CPU + ["algorithm=c3po"]),
              "v05": (base / "v05_resumed", FSDP_CPU + V05),
              "async1": (base / "async1_resumed", FSDP_CPU + ["algorithm.group_size=4", *ASYNC,
                                                              "rollout.max_staleness=1"]),
              # (a fourth run fills the pool's idle slot: two rounds of two either way)
              "c3po_async1": (base / "c3po_async1_resumed", FSDP_CPU + ["algorithm=c3po", *ASYNC,
                                                                        "rollout.max_staleness=1"])}
    _side_by_side({name: partial(_run, run_dir, first, ranks=2, steps=2) for name, (run_dir, first) in firsts.items()})
    return _side_by_side({name: partial(_run, run_dir, first + [f"resume={run_dir}/checkpoints/last.ckpt"], ranks=2)
                          for name, (run_dir, first) in firsts.items()})


@pytest.fixture(scope="module")
def sharded_eval(tiny_path, tmp_path_factory):
    """A 2-rank GRPO run saving a sharded checkpoint (a folder), then `mode=eval` of it on 2 ranks. Greedy
    held-out decoding, so the evaluation of the same weights gives the same figures in both processes. Both
    record the digest of every weight push (`PushCheck`): what each evaluation ran on."""
    base = tmp_path_factory.mktemp("fsdp")
    options = FSDP_CPU + ["algorithm.group_size=4", "algorithm.eval_temperature=0",
                          "trainer.strategy.save_distributed_checkpoint=true"]
    trained = _run(base / "sharded", options + ["eval_before=true"], ranks=2, steps=2)
    checkpoint = trained / "checkpoints" / "last.ckpt"
    return trained, _run(base / "sharded_eval", options + ["mode=eval", f"checkpoint={checkpoint}"], ranks=2)


def test_every_push_gives_each_rank_the_gathered_weights(runs):
    for name in ("two_ranks", "c3po_two_ranks"):
        for rank in (0, 1):
            pushes = _pushes(runs[name], rank)
            assert len(pushes) >= 3 and all(p["exact"] for p in pushes), (name, rank)
        assert [p["digest"] for p in _pushes(runs[name], 0)] == [p["digest"] for p in _pushes(runs[name], 1)]


# how each rank cut its own half of the batch into micro-batches (their count and padding), not what was learned;
# and the engine-trainer log-prob gap of the push check, float rounding (~1e-6) whose size follows the batch shape
LAYOUT = {"micro/count", "micro/padding_frac", "engine/sync_logp_diff"}


def test_two_ranks_match_one_rank_with_the_same_global_batch(runs):
    two, one = _rows(runs["two_ranks"]), _rows(runs["one_rank"])
    assert len(two) == len(one) == 3
    for step, (a, b) in enumerate(zip(two, one)):
        assert a.keys() == b.keys()
        for key in a.keys() - LAYOUT:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key)
    assert two[-1]["rollouts/total"] == 3 * 8 * 4  # summed over ranks: the global batch
    summary = json.loads((runs["two_ranks"] / "summary.json").read_text())
    assert summary["rollouts_total"] == 3 * 8 * 4


def test_bucket_size_changes_nothing(runs):
    small, default = runs["two_ranks_1kb_buckets"], runs["two_ranks"]
    assert _rows(small) == _rows(default)
    assert [p["digest"] for p in _pushes(small, 0)] == [p["digest"] for p in _pushes(default, 0)]


def test_c3po_ranks_receive_the_same_weight_samples_m_plus_sigma_eps(runs):
    pushes = _pushes(runs["c3po_two_ranks"], 0)
    samples = [p for p in pushes if "sample_index" in p]
    assert [p["sample_index"] for p in samples] == [0, 1, 2, 3] * 3  # N = 4 weight samples per step, 3 steps
    assert max(p["noise_max_err"] for p in samples) < 1e-6  # fp32 rounding of m + σ⊙ε
    assert len({p["digest"] for p in samples}) == len(samples)  # every sample differs


def test_c3po_on_lora_adapters_is_shard_local_and_exact(runs):
    """IVON's posterior over the adapters alone, sharded: each rank draws its shards' noise; every push (adapter
    tensors gathered from the shards) gives both engines m + σ⊙ε of the adapters."""
    run = runs["c3po_lora_two_ranks"]
    for rank in (0, 1):
        pushes = _pushes(run, rank)
        assert len(pushes) >= 3 and all(p["exact"] for p in pushes), rank
        samples = [p for p in pushes if "sample_index" in p]
        assert [p["sample_index"] for p in samples] == [0, 1, 2, 3] * 3
        assert max(p["noise_max_err"] for p in samples) < 1e-6
    assert [p["digest"] for p in _pushes(run, 0)] == [p["digest"] for p in _pushes(run, 1)]
    rows = _rows(run)
    # rank 4 x (in + out) of q, k, v, o, gate, up, down in each of the tiny model's 2 layers (width 64, MLP 192)
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 192), (64, 192), (192, 64)]
    adapter_numel = 2 * 4 * sum(i + o for i, o in shapes)  # 9728
    assert {r["noise/numel"] for r in rows} == {adapter_numel / 2}  # this rank's half of the adapters' shards
    assert all(r["engine/sync_logp_diff"] < 1e-4 for r in rows)


def test_c3po_resume_on_two_ranks_continues_exactly(runs, resumed):
    """IVON's shard-local state (saved per rank), the data position, RNG and the engine weights survive."""
    c3po_resumed = resumed["c3po"]
    rows, straight = _rows(c3po_resumed), _rows(runs["c3po_two_ranks"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows == straight
    assert _pushes(c3po_resumed, 0)[-1]["digest"] == _pushes(runs["c3po_two_ranks"], 0)[-1]["digest"]
    # the run's totals: the checkpoint holds the sum over ranks, not rank 0's own counts
    totals = [json.loads((run / "summary.json").read_text()) for run in (c3po_resumed, runs["c3po_two_ranks"])]
    for key in ("rollouts_total", "tokens_generated", "reward_failures"):
        assert totals[0][key] == totals[1][key], key


def test_v05_resume_on_two_ranks_continues_exactly(runs, resumed):
    """Each rank's V0 context (its own prompts' records), feature cache and head state survive a resume: the
    checkpoint, written by rank 0, holds every rank's."""
    rows, straight = _rows(resumed["v05"]), _rows(runs["v05_two_ranks"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert straight[-1]["v05/prior_present"] == 1.0  # the third step used the prior that was resumed
    assert rows == straight


@pytest.mark.parametrize("algorithm", ["v05", "c3po"])
def test_async_at_staleness_zero_on_two_ranks_is_the_synchronous_run(runs, algorithm):
    """V0.5, whose OSLA rounds run in each rank's producer: the ranks agree on each round over a gloo group of the
    producers' own (the trainer's threads run FSDP's collectives on the default one at the same time). C3PO, whose
    weight samples are drawn from each rank's shards at plan time and gathered there, in the trainer's thread, so
    the producers' pushes run no collective. At S = 0 either run is the synchronous one."""
    rows = _rows(runs[f"{algorithm}_async0_two_ranks"])
    untimed = [{k: v for k, v in row.items() if not k.startswith("async/")} for row in rows]
    assert len(rows) == 3 and untimed == _rows(runs[f"{algorithm}_two_ranks"])
    assert all(row["async/staleness_max"] == 0 for row in rows)


@pytest.mark.parametrize("run", ["async1", "c3po_async1"])
def test_async_on_two_ranks_saves_each_ranks_batches_in_flight_and_resumes(resumed, run):
    """S = 1 on 2 ranks, stopped after 2 steps and resumed: every checkpoint holds each rank's own batch in flight
    (its share of the data), and the resumed run generates it again with the restored weights, then trains on.
    C3PO too: there the producers push samples gathered at plan time while the trainers run FSDP's collectives."""
    run_dir = resumed[run]
    # the third update's batch was in flight at the stop: generated again by the weights it trains (staleness 0)
    assert [(r["step"], r["async/staleness_max"]) for r in _rows(run_dir)] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    ranks = saved["lit_rlvr"]["async"]["ranks"]
    assert [len(r["in_flight"]) for r in ranks] == [1, 1]
    prompts = [set(r["in_flight"][0][1]["prompt"]) for r in ranks]
    assert prompts[0] and prompts[1] and not prompts[0] & prompts[1]  # each rank's own rows


def test_eval_of_a_sharded_checkpoint_gives_the_trained_runs_accuracy(sharded_eval):
    trained, evaluated = sharded_eval
    assert (trained / "checkpoints" / "last.ckpt").is_dir()  # one shard per rank
    summary = json.loads((trained / "summary.json").read_text())
    result = json.loads((evaluated / "eval.json").read_text())
    # the evaluation ran on the trained weights, not the warm-up's: weights always change in 2 steps, greedy
    # accuracy may not (it did not on an AMD EPYC)
    initial, trained_last = _pushes(trained, 0)[0]["digest"], _pushes(trained, 0)[-1]["digest"]
    assert initial != trained_last
    assert {p["digest"] for rank in (0, 1) for p in _pushes(evaluated, rank)} == {trained_last}
    assert result["val/accuracy"] == summary["accuracy_after"]
    assert result["val/pass@k"] == summary["pass_at_k_after"]


def test_eval_of_a_sharded_checkpoint_without_fsdp_says_how(sharded_eval, tmp_path):
    checkpoint = sharded_eval[0] / "checkpoints" / "last.ckpt"
    done = subprocess.run([sys.executable, "train.py", "mode=eval", f"checkpoint={checkpoint}", "data.num_test=16",
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "is a sharded checkpoint" in done.stderr and "trainer=fsdp32" in done.stderr, done.stderr[-2000:]


def test_3po_async_on_lora_on_two_ranks_is_refused_before_any_step(tiny_path, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *FSDP_CPU, "algorithm=c3po", "model.lora.rank=4", "rollout.mode=async", "trainer.max_steps=1",
           "eval_before=false", "data.num_test=4", "callbacks.progress=null", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "rollout.mode=async with algorithm.optimizer=ivon (3PO) and model.lora on 2 ranks" in \
        done.stdout + done.stderr
    assert not list(tmp_path.glob("checkpoints/*"))


def test_ivon_on_plain_ddp_ranks_is_refused(tiny_path, tmp_path):
    """DDP ranks would each pair their own noise with the averaged gradient and drift apart: 3PO needs FSDP."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "algorithm=c3po", "trainer.devices=2", "trainer.max_steps=1", "eval_before=false", "data.num_test=4",
           "callbacks.progress=null", "engine.options.mode=copy", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "algorithm.optimizer=ivon on 2 ranks needs trainer=fsdp" in done.stdout + done.stderr
    assert not list(tmp_path.glob("checkpoints/*"))  # refused before any step
