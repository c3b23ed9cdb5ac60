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


def rows(tokens: float, gen_flops: float, update_flops: float, steps: int = 3) -> list[dict]:
    """StepRecorder rows of `steps` steps with this work each (1 s generation, 2 s update)."""
    return [{"wall_s": 3.0, "tokens": tokens, "time/gen_s": 1.0, "time/train_s": 2.0,
             "perf/flops_per_s_gen": gen_flops, "perf/flops_per_s_update": update_flops / 2.0}] * steps


def test_compare_trl_states_its_sides_and_why_they_differ_by_design():
    import compare_trl

    trl = {"tokens": [999.0, 200.0, 200.0], "flops": [(1.0, 1.0), (12.0, 30.0), (12.0, 30.0)]}  # warm-up first
    entry = compare_trl.work(argparse.Namespace(warmup=1), rows(200.0, 10.0, 30.0), trl)
    assert entry["sides"]["trl"] == {"tokens": 200.0, "gen_flops": 12.0, "update_flops": 30.0, "flops": 42.0}
    assert entry["sides"]["ours"]["flops"] == 40.0 and entry["tokens_spread"] == 0.0
    assert entry["equal_work"] is False and "TRL prefills every row" in entry["by_design"]  # 5 % more FLOPs


def test_async_overlap_averages_each_sides_work_over_the_rounds():
    import async_overlap
    import common

    def one_round(tokens_async: float) -> dict:
        work = {name: common.work_per_step(rows(100.0, 10.0, 30.0), 1) for name in async_overlap.CONFIGS}
        work["async_s1"] = common.work_per_step(rows(tokens_async, 10.0, 30.0), 1)
        return {"async_over_ideal": 1.2, "_work": work}

    rounds = [one_round(100.0), one_round(110.0)]
    entries = async_overlap.work(rounds)
    assert "_work" not in rounds[0]  # popped: the rounds' medians are taken over the figures only
    ideal = entries["async_over_ideal_work"]
    assert ideal["sides"]["async_s1"]["tokens"] == 105.0 and ideal["sides"]["sync_1core"]["tokens"] == 100.0
    assert ideal["equal_work"] is False and set(entries) == {
        "async_over_ideal_work", "thread_over_ideal_work", "async_over_sync_2cores_work", "partial_over_async_s1_work"}


def test_async_overlap_ratios_from_each_configurations_steps():
    """The partial-rollout configuration against async S = 1, and each wait share from its own configuration."""
    import async_overlap

    def timed(wall_s: float, **logged: float) -> list[dict]:
        return [{**row, "wall_s": wall_s, **logged} for row in rows(100.0, 10.0, 30.0)]

    # each run's peak RSS (MB): (its trainer's process, its engine's process or 0)
    runs = {"sync_1core": (timed(3.0), (100.0, 0.0)), "sync_2cores": (timed(2.5), (100.0, 0.0)),
            "async_s1": (timed(2.4, **{"async/trainer_wait_frac": 0.3, "async/buffer_mb": 0.5}), (80.0, 30.0)),
            "async_s2": (timed(2.2, **{"async/trainer_wait_frac": 0.05, "async/buffer_mb": 0.75}), (80.0, 30.0)),
            "async_s1_thread": (timed(2.6), (110.0, 0.0)),
            "async_s1_partial": (timed(1.8, **{"async/partial_frac": 0.5}), (80.0, 30.0))}
    figures = async_overlap.summarise(runs, warmup=1)
    assert figures["partial_over_async_s1"] == 1.8 / 2.4 and figures["partial_frac"] == 0.5
    assert figures["trainer_wait_frac_s1"] == 0.3 and figures["trainer_wait_frac_s2"] == 0.05
    assert figures["async_over_ideal"] == 2.4 / 2.0 and figures["rss_async_over_sync"] == 1.1
    assert (figures["rss_sync_mb"], figures["rss_async_trainer_mb"], figures["rss_async_engine_mb"]) == (100, 80, 30)
    assert (figures["buffer_peak_mb_s1"], figures["buffer_peak_mb_s2"]) == (0.5, 0.75)
    assert figures["thread_over_ideal"] == 2.6 / 2.0


def test_the_context_names_what_sets_the_matmul_speed(tmp_path):
    """Beside the load: torch's kernel level, its BLAS, and how many cores the logical CPUs are on."""
    import common

    context = common.context()
    assert context["cpu_capability"] in {"DEFAULT", "NO AVX", "AVX2", "AVX512", "Z VECTOR", "VSX", "SVE256"}
    assert context["blas"] and context["logical_cpus"] >= 1
    assert context["physical_cores"] is None or 1 <= context["physical_cores"] <= context["logical_cpus"]
    for cpu, siblings in enumerate(["0-1", "0-1", "2", "3"]):  # CPUs 0 and 1: two hyperthreads of one core
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{siblings}\n")
    assert common.physical_cores([0, 1], tmp_path) == 1
    assert common.physical_cores([0, 1, 2, 3], tmp_path) == 3
    assert common.physical_cores([0, 7], tmp_path) is None
