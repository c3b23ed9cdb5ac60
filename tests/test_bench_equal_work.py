"""Equal work (bench/README.md): every ratio of two configurations states each side's generated tokens and model
FLOPs per step, and is flagged (`--strict`: refused) when they are more than the tolerance apart."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def side(tokens: float, gen: float, update: float) -> dict:
    return {"tokens": tokens, "gen_flops": gen, "update_flops": update}


def test_equal_work_holds_up_to_the_tolerance_and_not_beyond():
    import common

    # 0.25 and these figures are exact in binary: the boundary itself is tested, not its rounding
    base = side(100.0, 40.0, 60.0)
    at = common.equal_work({"a": base, "b": side(125.0, 50.0, 75.0)}, tol=0.25)
    assert at["equal_work"] and at["tokens_spread"] == 0.25 and at["flops_spread"] == 0.25
    assert at["sides"]["b"]["flops"] == 125.0  # generation + update
    over_tokens = common.equal_work({"a": base, "b": side(125.5, 40.0, 60.0)}, tol=0.25)
    assert not over_tokens["equal_work"] and over_tokens["flops_spread"] == 0.0
    over_flops = common.equal_work({"a": base, "b": side(100.0, 40.0, 85.5)}, tol=0.25)
    assert not over_flops["equal_work"] and over_flops["tokens_spread"] == 0.0
    # symmetric: which side is larger does not matter
    assert not common.equal_work({"a": side(125.5, 40.0, 60.0), "b": base}, tol=0.25)["equal_work"]
    # the default 3 %: 1030 against 1000 is within, 1031 is not
    assert common.EQUAL_WORK_TOL == 0.03
    assert common.equal_work({"a": side(1000.0, 1.0, 1.0), "b": side(1030.0, 1.0, 1.0)})["equal_work"]
    assert not common.equal_work({"a": side(1000.0, 1.0, 1.0), "b": side(1031.0, 1.0, 1.0)})["equal_work"]


def test_equal_work_never_passes_a_missing_figure_and_refuses_a_bad_tolerance():
    import common

    missing = common.equal_work({"a": side(10.0, 1.0, 1.0), "b": side(10.0, math.nan, 1.0)})
    assert not missing["equal_work"] and math.isnan(missing["flops_spread"]) and missing["tokens_spread"] == 0.0
    assert common.spread([0.0, 0.0]) == 0.0 and common.spread([0.0, 1.0]) == math.inf
    assert common.equal_work({"a": side(0.0, 0.0, 0.0), "b": side(0.0, 0.0, 0.0)})["equal_work"]
    with pytest.raises(ValueError, match="tolerance 1.5"):
        common.equal_work({"a": side(1.0, 1.0, 1.0), "b": side(1.0, 1.0, 1.0)}, tol=1.5)


def test_report_flags_unequal_work_and_strict_refuses_naming_both_sides(capsys):
    import common

    entry = common.equal_work({"grpo": side(6400.0, 2e9, 6e9), "c3po": side(3600.0, 1.2e9, 3.4e9)},
                              by_design="c3po prefills each prompt per weight sample")
    result = {"c3po_over_grpo": 0.57, "c3po_over_grpo_work": entry}
    common.report(dict(result), argparse.Namespace(json=True, strict=False), "step_time.py")
    out, err = capsys.readouterr()
    printed = json.loads(out.strip().splitlines()[-1])
    assert printed["equal_work"] is False and printed["c3po_over_grpo_work"]["equal_work"] is False
    assert "c3po_over_grpo compares unequal work" in err and "grpo 6400 tokens" in err and "c3po 3600 tokens" in err
    assert "by design: c3po prefills" in err
    with pytest.raises(SystemExit) as refused:
        common.report(dict(result), argparse.Namespace(json=True, strict=True), "step_time.py")
    out, err = capsys.readouterr()
    assert refused.value.code == 3 and out == ""  # no ratio printed
    assert "--strict: refused" in err and "grpo 6400 tokens, 8e+09 FLOPs" in err and "c3po 3600 tokens" in err


def test_step_time_compare_states_each_sides_tokens_and_flops(tmp_path):
    """A real `--compare` on a smaller tiny workload (2 prompts x 2 completions, one step): the entry capped at 1
    new token generates exactly 4 tokens, GRPO more, and the ratio is flagged."""
    small = ["data.batch_size=2", "algorithm.group_size=2", "algorithm.max_new_tokens=6"]
    done = subprocess.run([sys.executable, str(ROOT / "bench/step_time.py"), "--compare",
                           "grpo,grpo+algorithm.max_new_tokens=1", "--steps", "1", "--warmup", "0", "--json",
                           *(a for o in small for a in ("--override", o))],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = "grpo+algorithm.max_new_tokens=1_over_grpo"
    work = result[f"{ratio}_work"]
    grpo, short = work["sides"]["grpo"], work["sides"]["grpo+algorithm.max_new_tokens=1"]
    assert short["tokens"] == 4 and grpo["tokens"] > 4  # one token per completion; the tiny answers are longer
    for figures in (grpo, short):
        assert figures["gen_flops"] > 0 and figures["update_flops"] > 0
        assert math.isclose(figures["flops"], figures["gen_flops"] + figures["update_flops"], rel_tol=1e-5)
    assert grpo["flops"] > short["flops"]
    assert work["equal_work"] is False and result["equal_work"] is False and work["tol"] == 0.03
    assert f"{ratio} compares unequal work" in done.stderr
