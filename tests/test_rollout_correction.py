"""lit_rlvr.functional.rollout_correction against verl's own functions, and the options' checks.

Expected numbers: tests/fixtures/rollout_correction/verl_0_9_1.json, written by make_verl_fixtures.py beside it,
which runs the released verl 0.9.1 (`pip install verl==0.9.1` in a throwaway venv: verl's dependencies are not
lit-rlvr's) on fixed float64 inputs: `compute_rollout_correction_weights`, `compute_rollout_rejection_mask` and
`compute_offpolicy_metrics` of verl/trainer/ppo/rollout_corr_helper.py, and verl v0.6.1's
`compute_rollout_rejection_mask` for the old level names token / sequence / geometric. Nothing of verl is
imported here; the same inputs go through lit-rlvr's functions and must agree to 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_rlvr.functional import rollout_correction as RC
from lit_rlvr.config.rollout_correction import RolloutCorrection

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "rollout_correction" / "verl_0_9_1.json").read_text())
CASES = FIXTURE["cases"]


def _tensors(case):
    trainer, engine = (torch.tensor(case[k], dtype=torch.float64) for k in ("trainer", "engine"))
    return trainer, engine, torch.tensor(case["mask"])


def test_fixture_is_verls_release_with_cases_that_exercise_the_bounds():
    """Every rejection spec rejects part of the tokens in some case (a mask that keeps or drops all would match
    anything), and some IS weights are truncated or zeroed."""
    assert FIXTURE["verl"] == "0.9.1" and FIXTURE["old_verl"] == "0.6.1" and len(CASES) == 3
    for key in ("rs", "old_rs"):
        for i, spec in enumerate(CASES[0][key]):
            assert any(0 < case[key][i]["masked_fraction"] < 1 for case in CASES), spec["modes"]
    assert all(spec["fraction_high"] > 0 for spec in CASES[2]["is"])


@pytest.mark.parametrize("index", range(3))
def test_importance_weights_equal_verls(index):
    trainer, engine, mask = _tensors(CASES[index])
    for case in CASES[index]["is"]:
        weights, metrics = RC.truncated_is_weights(trainer - engine, mask, level=case["level"],
                                                   threshold=case["threshold"])
        expected = torch.tensor(case["weights"], dtype=torch.float64)
        torch.testing.assert_close(weights, expected, atol=1e-6, rtol=0, msg=str(case["threshold"]))
        if isinstance(case["threshold"], str) and "_" in case["threshold"]:  # IcePop: outside [a, b]
            assert float(metrics["mismatch/is_clip_frac"]) == pytest.approx(case["oob"], abs=1e-6)
        elif case["level"] == "token":  # TIS: above C
            assert float(metrics["mismatch/is_clip_frac"]) == pytest.approx(case["fraction_high"], abs=1e-6)


@pytest.mark.parametrize("index", range(3))
def test_rejection_masks_equal_verls(index):
    trainer, engine, mask = _tensors(CASES[index])
    for case in CASES[index]["rs"] + CASES[index]["old_rs"]:
        keep, metrics = RC.rejection_mask(trainer - engine, mask, modes=case["modes"], threshold=case["threshold"])
        expected = torch.tensor(case["mask"], dtype=torch.float64).bool()
        assert torch.equal(keep, expected), (case["modes"], case["threshold"])
        assert float(metrics["mismatch/rs_masked_frac"]) == pytest.approx(case["masked_fraction"], abs=1e-6)


@pytest.mark.parametrize("index", range(3))
def test_mismatch_metrics_equal_verls(index):
    trainer, engine, mask = _tensors(CASES[index])
    kl, metrics = RC.mismatch_metrics(trainer, engine, mask)
    expected = CASES[index]["offpolicy"]
    assert float(kl) == float(metrics["mismatch/kl"]) == pytest.approx(expected["k3_kl"], abs=1e-6, rel=1e-6)
    assert float(metrics["mismatch/ppl_ratio"]) == pytest.approx(expected["ppl_ratio"], abs=1e-6, rel=1e-6)
    assert float(metrics["mismatch/is_weight_max"]) == pytest.approx(expected["is_max"], abs=1e-6, rel=1e-6)


def test_old_level_names_are_the_k1_options():
    trainer, engine, mask = _tensors(CASES[2])
    for old, new in RC.RS_ALIASES.items():
        for threshold in (1.5, "0.7_1.6"):
            a, _ = RC.rejection_mask(trainer - engine, mask, modes=old, threshold=threshold)
            b, _ = RC.rejection_mask(trainer - engine, mask, modes=new, threshold=threshold)
            assert torch.equal(a, b)


def test_no_mismatch_means_weights_one_nothing_rejected_and_zero_kl():
    logp = -torch.rand(4, 5) * 3
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    kl, metrics = RC.mismatch_metrics(logp, logp.clone(), mask)
    assert float(kl) == 0.0 and float(metrics["mismatch/ppl_ratio"]) == 1.0
    assert float(metrics["mismatch/is_weight_max"]) == 1.0
    weights, _ = RC.truncated_is_weights(logp - logp, mask, level="sequence", threshold=2.0)
    assert torch.equal(weights, mask.float())
    keep, m = RC.rejection_mask(logp - logp, mask, modes="token,sequence,geometric,seq_max_k3", threshold="1.01")
    assert torch.equal(keep, mask) and float(m["mismatch/rs_masked_frac"]) == 0.0


def test_weights_carry_no_gradient_and_padding_never_counts():
    log_ratio = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    weights, _ = RC.truncated_is_weights(log_ratio * 5, mask, level="token", threshold=2.0)
    assert not weights.requires_grad and float(weights[~mask].abs().sum()) == 0.0
    keep, _ = RC.rejection_mask(log_ratio * 5, mask, modes="token", threshold=2.0)
    assert not keep[~mask].any()


@pytest.mark.parametrize("options,key", [
    ({"rollout_is": "seq"}, "rollout_is"),
    ({"rollout_is": "token", "rollout_is_threshold": 0}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "rollout_is_threshold"),
    ({"rollout_rs": "tokn"}, "rollout_rs"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": "0.1_0.2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token,sequence", "rollout_rs_threshold": "2,3,4"}, "rollout_rs_threshold"),
    ({"rollout_is": "token", "bypass_mode": True}, "rollout_is"),
    ({"bypass_mode": "yes"}, "bypass_mode"),
    ({"loss_type": "reinforce"}, "loss_type"),
    ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
    ({"rollout_token_veto_threshold": 1e-4}, "rollout_token_veto_threshold"),
])
def test_bad_options_fail_in_one_line_naming_the_key(options, key):
    with pytest.raises(ValueError) as err:
        RolloutCorrection.from_options(options)
    message = str(err.value)
    assert f"algorithm.rollout_correction.{key}" in message and "\n" not in message, message


def test_defaults_measure_only_and_a_correction_implies_decoupled_mode():
    default = RolloutCorrection.from_options(None)
    assert not default.corrects and default.bypass
    assert RolloutCorrection.from_options({"loss_type": "ppo_clip", "rollout_is_batch_normalize": False}) == default
    assert not RolloutCorrection.from_options({"rollout_rs": "sequence"}).bypass  # verl's default bypass_mode
    assert RolloutCorrection.from_options({"rollout_rs": "sequence", "bypass_mode": True}).bypass
    assert not RolloutCorrection.from_options({"bypass_mode": False}).bypass
    assert RolloutCorrection.from_options({"rollout_rs": "sequence"}).rs_threshold == 2.0  # verl 0.6: the IS one


def test_train_py_names_a_bad_option_in_one_line_before_any_work(tmp_path):
    cmd = [sys.executable, "train.py", "algorithm.rollout_correction.rollout_rs=tokn", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=os.environ.copy(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "algorithm.rollout_correction.rollout_rs='tokn'" in errors[0], done.stderr[-2000:]
    assert not (tmp_path / "metrics.csv").exists()
