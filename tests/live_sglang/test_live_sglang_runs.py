"""Whole `python train.py engine=sglang_cpu` runs on a CPU: GRPO, C3PO and V0.5 end with summary.json, a GRPO
run resumed from its last.ckpt pushes the weights its first part ended with, C3PO on LoRA adapters samples its N
weight samples as N adapters over one base, two ranks (torchrun, FSDP2 over gloo) each drive their own engine, and
an asynchronous run generates one batch ahead with pushes between the producer's batches.
The runs (train_runs.py) start with the session and go two at a time, beside the other modules' engine tests; the
GRPO run is also the first part of the resumed one."""

import csv
import json
import math
from pathlib import Path

import pytest

from sglang_live import REPO, live

pytestmark = live


def _pushes(run_dir: Path, rank: int = 0) -> list[dict]:
    return json.loads((run_dir / f"push_probe_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def runs(train_runs):
    """The runs of train_runs.RUNS (started by conftest.py at the session's start), once all have ended."""
    return train_runs.result()


@pytest.mark.parametrize("name,steps", [("grpo", 2), ("c3po", 3), ("v05", 2)])
def test_run_ends_with_summary(runs, name, steps):
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert summary["steps"] == steps
    pushes = _pushes(runs[name])
    assert {p["step"] for p in pushes} >= set(range(1, steps + 1))  # a push after every optimizer step
    assert len({p["digest"] for p in pushes if p["holds_mean"]}) > 1  # the weights changed
    kl = _column(runs[name], "mismatch/kl")
    assert len(kl) == steps and all(math.isfinite(v) and v >= 0 for v in kl), kl  # the engine's drift, every step


def test_fp32_sglang_engine_drifts_from_the_trainer_by_float_rounding_only(runs):
    """GRPO: each step's loss forward runs at the weights SGLang sampled with (fp32 on a CPU, log-probs within 3e-7
    of the trainer's), so the k3 of their log-probs is at float-rounding level and no IS weight leaves 1."""
    assert max(_column(runs["grpo"], "mismatch/kl")) < 1e-8
    assert all(abs(w - 1) < 1e-3 for w in _column(runs["grpo"], "mismatch/is_weight_max"))


def _column(run_dir: Path, key: str) -> list[float]:
    with (run_dir / "metrics.csv").open() as handle:
        return [float(r[key]) for r in csv.DictReader(handle) if r.get(key)]


def test_c3po_on_lora_samples_adapters_over_one_base(runs):
    """C3PO on rank-4 adapters through sglang's multi-LoRA serving: the noise covers the adapters alone, the engine
    serves the trained adapter after every push (the post-push check, fp32: float rounding), and its N weight
    samples go as adapters in one call (no push of sampled weights: every recorded push holds the mean)."""
    summary = json.loads((runs["c3po_lora"] / "summary.json").read_text())
    assert summary["steps"] == 2
    from safetensors.torch import load_file

    adapter = load_file(runs["c3po_lora"] / "checkpoints" / "adapter" / "adapter_model.safetensors")
    numel = _column(runs["c3po_lora"], "noise/numel")
    assert numel and set(numel) == {float(sum(t.numel() for t in adapter.values()))}, numel
    diffs = _column(runs["c3po_lora"], "engine/sync_logp_diff")
    assert diffs and all(d < 1e-4 for d in diffs), diffs
    pushes = _pushes(runs["c3po_lora"])
    assert pushes and all(p["holds_mean"] for p in pushes)
    assert len({p["digest"] for p in pushes}) > 1  # the adapters trained


def test_c3po_pushes_once_per_weight_sample(runs):
    from omegaconf import OmegaConf

    from lit_rlvr import ParamNoise

    # the YAML leaves num_samples null; the callback resolves it per variant (the one place that default lives)
    options = OmegaConf.load(REPO / "conf" / "algorithm" / "callbacks" / "param_noise.yaml")
    samples = ParamNoise(variant="c3po", num_samples=options.num_samples).num_samples
    assert samples > 1
    pushes = _pushes(runs["c3po"])
    for step in range(3):
        sampled = [p for p in pushes if p["step"] == step and not p["holds_mean"]]
        assert len(sampled) == samples and len({p["digest"] for p in sampled}) == samples, (step, pushes)


def test_resumed_run_pushes_the_weights_its_first_part_ended_with(runs):
    """sglang ignores per-request seeds on a CPU, so the resumed steps cannot be compared with an uninterrupted
    run's; what resume must keep is checked instead: the first push after resume is the last push before it,
    bit for bit, and the live engine answers the probe the same."""
    before = [p for p in _pushes(runs["grpo"]) if p["holds_mean"]][-1]
    after = _pushes(runs["resumed"])[0]
    assert before["step"] == after["step"] == 2
    assert after["digest"] == before["digest"]
    assert after["probe_ids"] == before["probe_ids"] and after["probe_logprobs"] == before["probe_logprobs"]
    assert (runs["resumed"] / "summary.json").exists()


def test_two_ranks_each_with_its_own_engine(runs):
    """torchrun, FSDP2 over gloo: each rank starts its own sglang engine (ports spaced by local rank) and
    receives the gathered weights; both ranks push the same weights at every step."""
    run_dir = runs["ranks2"]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    rank0, rank1 = _pushes(run_dir, 0), _pushes(run_dir, 1)
    assert {p["step"] for p in rank0} >= {1, 2} and len(rank0) == len(rank1)
    for a, b in zip(rank0, rank1):  # the same gathered weights, and each live engine answers the probe alike
        assert (a["step"], a["digest"], a["probe_ids"]) == (b["step"], b["digest"], b["probe_ids"])


def test_async_run_generates_one_batch_ahead_and_its_pushes_land_in_flight(runs):
    assert _column(runs["async"], "async/staleness_max") == [0.0, 1.0, 1.0]  # generated a version before it trained
    assert all(0 <= v <= 1 for v in _column(runs["async"], "async/partial_frac"))  # (how many: the machine's timing)
    assert all(math.isfinite(v) for v in _column(runs["async"], "loss/policy"))
    # a gradient wherever a group's rewards differ (a batch of uniform groups has none: GRPO's advantages are 0)
    steps = zip(_column(runs["async"], "grad/norm"), _column(runs["async"], "groups/zero_adv_frac"))
    assert all(norm > 0 for norm, uniform in steps if uniform < 1)
    pushes = [p for p in _pushes(runs["async"]) if p["holds_mean"]]
    steps = [p["step"] for p in pushes]  # (the evaluation after training pushes again to the woken engine)
    assert {1, 2, 3} <= set(steps) and len({p["digest"] for p in pushes}) == len(set(steps))
    # after each push the live engine answered the probe: it served the pushed weights while the producer waited
    assert all(p["probe_ids"] for p in pushes)
