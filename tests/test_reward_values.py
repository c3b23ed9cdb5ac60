"""What a reward returns and what it may change (issue 34, classes 1-3): a value that cannot become a finite
float is malformed and counted, never a crash; numpy and torch scalars (0-d arrays and tensors too) are scores
by one rule (docs/rewards.md); a reward that changes its prompt or answer changes nothing that a later call,
step or evaluation sees. Each in both isolation modes and for a batch reward; and one `python train.py` run
with such a reward. With FAULT_REPORT=PATH each test appends a JSON line (scripts/fault_report.py)."""

import csv
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_rlvr.rewards import build_reward_runner
from tests import hostile_rewards as H
from tests.test_faults import report

REPO = Path(__file__).resolve().parents[1]
# a generous bound: a worker that returns a tensor imports torch first (seconds on a loaded machine)
ISOLATIONS = {"none": {"timeout_s": 120}, "process": {"isolation": "process", "workers": 2, "timeout_s": 120}}


def _score(isolation: str, names: list[str], caplog) -> tuple:
    runner = build_reward_runner("tests.hostile_rewards:by_name", dict(ISOLATIONS[isolation]))
    try:
        with caplog.at_level(logging.WARNING):
            batch = runner(["p"] * len(names), names, [None] * len(names))
            again = runner(["p"] * len(names), names, [None] * len(names))  # warned once per kind, not per call
    finally:
        runner.close()
    return batch, again


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_values_that_cannot_become_a_finite_float_are_malformed_never_a_crash(isolation, caplog):
    names = list(H.NOT_FINITE)
    batch, again = _score(isolation, names, caplog)
    assert "failed" not in caplog.text  # no call raised or timed out: each value broke the contract itself
    assert batch.malformed.all() and (batch.scores == -1.0).all() and torch.isfinite(batch.scores).all()
    assert batch.failures == len(names) == again.failures
    warnings = [r.getMessage() for r in caplog.records if "warned once" in r.getMessage()]
    assert warnings and len(warnings) == len(set(warnings)) <= len(names)  # once per kind over both batches
    assert any("10**400" in w or "int too large" in w or "OverflowError" in w for w in warnings), warnings
    if isolation == "process":
        report(fault="reward returns 10**400/NaN/sNaN/...", bad_inputs=2 * len(names), survived=True, data_lost=0)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_numpy_and_torch_scalars_are_scores_by_one_rule(isolation, caplog):
    names = list(H.SCALARS)
    batch, _ = _score(isolation, names, caplog)
    assert batch.failures == 0 and not batch.malformed.any(), caplog.text[-2000:]
    assert batch.scores.tolist() == [H.SCALARS[n][1] for n in names]
    others = list(H.NOT_A_SCORE)  # one rule: anything else is malformed, with the type in the warning
    batch, _ = _score(isolation, others, caplog)
    assert batch.malformed.all() and batch.failures == len(others)
    assert any("with a dimension" in r.getMessage() and "shape [1]" in r.getMessage() for r in caplog.records)
    if isolation == "process":
        report(fault="reward returns numpy/torch scalars", bad_inputs=2 * len(names + others), survived=True,
               data_lost=0)


PROMPTS = ["1+1=", [{"role": "user", "content": "2+2="}], "3+3="]  # a plain prompt and chat messages


def _answers() -> list:
    return [["2", "two"], {"value": "4", "alts": ["four", "IV"]}, {"nested": {"deep": [6]}}]


@pytest.mark.parametrize("reward,isolation", [("tests.hostile_rewards:mutating", "none"),
                                              ("tests.hostile_rewards:mutating", "process"),
                                              ("tests.hostile_rewards:MutatingBatch", "none")])
def test_a_reward_that_changes_its_arguments_changes_nothing_later_calls_see(reward, isolation, tmp_path,
                                                                             monkeypatch):
    pristine = {json.dumps(p, sort_keys=True): a for p, a in zip(PROMPTS, _answers())}
    (tmp_path / "pristine.json").write_text(json.dumps(pristine))
    monkeypatch.setenv("PRISTINE", str(tmp_path / "pristine.json"))  # reward worker processes read it
    monkeypatch.setattr(H, "PRISTINE", pristine)
    prompts, answers = [json.loads(json.dumps(p)) for p in PROMPTS], _answers()  # the caller's (the data set's)
    group = 4  # each prompt's answer object is shared by its group, as the rollout driver passes it
    runner = build_reward_runner(reward, dict(ISOLATIONS[isolation]))
    try:
        for _step in range(3):
            owners = [g for g in range(len(prompts)) for _ in range(group)]
            batch = runner([prompts[g] for g in owners], ["c"] * len(owners), [answers[g] for g in owners])
            assert batch.failures == 0 and batch.scores.tolist() == [1.0] * len(owners)  # every call saw pristine args
    finally:
        runner.close()
    assert prompts == PROMPTS and answers == _answers()  # and the caller's objects are as they were
    report(fault=f"reward mutates its arguments ({isolation}{', batch' if 'Batch' in reward else ''})",
           bad_inputs=3 * group * len(prompts), survived=True, data_lost=0)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_an_answer_that_cannot_be_copied_fails_that_call_only(isolation, monkeypatch):
    import threading

    monkeypatch.setattr(H, "PRISTINE", {json.dumps("p"): "a"})
    runner = build_reward_runner("tests.hostile_rewards:mutating", dict(ISOLATIONS[isolation]))
    try:
        batch = runner(["p", "p", "p"], ["c"] * 3, ["a", {"lock": threading.Lock()}, "a"])
    finally:
        runner.close()
    assert batch.failures == 1 and batch.malformed.tolist() == [False, True, False]


# -- end to end: python train.py with such a reward ------------------------------------------------------------
def test_train_py_with_a_hostile_reward_survives_and_its_data_stays_pristine(tmp_path, tiny_path):
    """A JSONL data set whose answers are lists; the reward changes prompt and answer, returns numpy bools,
    0-d tensors and numpy floats (1 while its arguments are pristine) and 10**400 now and then."""
    rows = [{"prompt": f"{a}+{b}=", "answer": [str(a + b), "unused"]} for a in range(10, 14) for b in range(20, 24)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pristine.json").write_text(json.dumps({json.dumps(r["prompt"]): r["answer"] for r in rows}))
    run_dir, log = tmp_path / "run", tmp_path / "overflows.log"
    env = {**os.environ, "PRISTINE": str(tmp_path / "pristine.json"), "HOSTILE_LOG": str(log)}
    done = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={run_dir}", "trainer.max_steps=2",
                           f"model.name_or_path={tiny_path}", "model.dtype=float32", "model.chat_template=false",
                           "reward.name=tests.hostile_rewards:hostile", "data=jsonl", f"data.path={data}",
                           f"data.eval_path={data}", "data.batch_size=4", "algorithm.group_size=4",
                           "algorithm.max_new_tokens=8",
                           "callbacks.progress=null", "callbacks.completions.every_n_steps=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    overflows = len(log.read_text().splitlines()) if log.exists() else 0
    assert summary["reward_failures"] == overflows  # each 10**400 counted, nothing else
    with (run_dir / "metrics.csv").open() as handle:
        means = [float(r["reward/mean"]) for r in csv.DictReader(handle) if r.get("reward/mean")]
        malformed = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("reward/malformed_frac")]
    # every call that did not overflow saw pristine arguments: its score is 1, an overflow's is -1
    for mean, row in zip(means, malformed):
        frac = float(row["reward/malformed_frac"])
        assert math.isclose(mean, (1 - frac) * 1.0 + frac * -1.0, abs_tol=1e-6), (mean, frac)
    completions = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert completions and all(json.loads(c["answer"].replace("'", '"')) in [r["answer"] for r in rows]
                               for c in completions)
    report(fault="train.py: reward mutates, numpy/torch, 10**400", bad_inputs=overflows + summary["rollouts_total"],
           survived=True, data_lost=0)
