"""The long-workload benchmarks' own logic: micro_batches.py's gradient check runs for real (tiny workload), and
scaling.py's growth slope and figure come out of its JSON. Timings are never asserted (docs/architecture.md §9)."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_micro_batches_bench_compares_equal_gradients_with_less_padding(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench/micro_batches.py"), "--workload", "tiny", "--tokens",
                           "16,64", "--repeats", "1", "--warmup", "0", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["completions"] == 64
    for tokens in (16, 64):
        assert result[f"tokens_{tokens}_grad_rel_diff"] < 1e-5  # the same update, partitioned differently
        assert result[f"tokens_{tokens}_padding_frac"] < result["fixed_padding_frac"]
        assert result[f"tokens_{tokens}_s"] > 0 and len(result["spread"][f"tokens_{tokens}"]) == 1


def test_scaling_slope_reads_growth_and_the_figure_is_drawn(tmp_path):
    import scaling

    points = [{"axis": "length", "value": v, "grpo": {"step_s": 0.01 * v, "peak_rss_mb": 900.0},
               "c3po": {"step_s": 0.001 * v * v, "peak_rss_mb": 950.0}, "trl": {"error": "not installed"}}
              for v in (16, 32, 64)]
    assert math.isclose(scaling.slope(points, "grpo"), 1.0)  # linear
    assert math.isclose(scaling.slope(points, "c3po"), 2.0)  # quadratic
    assert math.isnan(scaling.slope(points, "trl"))  # no timings, no slope
    out, figure = tmp_path / "scaling.json", tmp_path / "scaling.png"
    out.write_text(json.dumps({"points": points}))
    scaling.main(["--plot-only", "--out", str(out), "--figure", str(figure)])
    assert figure.stat().st_size > 10_000


def test_scaling_points_fix_the_length_and_move_one_axis():
    import scaling

    length = scaling.point_overrides("length", 128)
    assert {"algorithm.ignore_eos=true", "algorithm.max_new_tokens=128", "algorithm.group_size=8"} <= set(length)
    assert not any(o.startswith("task_max_new_tokens") for o in length)  # would retrain the cached model
    width = scaling.point_overrides("width", 512)
    assert "model.options.hidden_size=512" in width and "algorithm.max_new_tokens=64" in width


def test_step_time_reports_model_flops_utilisation(tmp_path):
    """`step_time.py --json` carries the medians of the module's perf/mfu_* and the peak they divide by."""
    # one timed step: its medians are that step's figures, so the MFU's relation holds exactly (with several,
    # a median of per-step ratios is not the ratio of medians, and a loaded machine pulls them apart)
    done = subprocess.run([sys.executable, str(ROOT / "bench/step_time.py"), "--steps", "1", "--warmup", "0",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["peak_flops"] > 0 and result["cpu"]
    for phase in ("gen", "update"):
        assert 0 < result[f"mfu_{phase}"] and result[f"{phase}_flops"] > 0
        # the MFU is the phase's model FLOPs over its seconds and the peak
        seconds = result["gen_s" if phase == "gen" else "train_s"]
        assert math.isclose(result[f"mfu_{phase}"], result[f"{phase}_flops"] / seconds / result["peak_flops"],
                            rel_tol=1e-3)


def test_trl_flops_prefill_every_row():
    """TRL's generation prefills each of its rows (transformers' `generate`); its update is one forward +
    backward."""
    import compare_trl
    import torch

    from lit_rlvr import functional as F
    from lit_rlvr.models.tiny import build_tiny
    from lit_rlvr.run.perf import transformer_shape

    model, tokenizer = build_tiny()
    prompts = ["1+2=", "1+2=", "30+4=", "30+4="]
    (gen, update), = compare_trl.trl_flops(model, tokenizer, [(prompts, [3, 5, 2, 7])])
    shape = transformer_shape(model.config)
    p, r = torch.tensor([4, 4, 5, 5]), torch.tensor([3, 5, 2, 7])
    assert gen == float(F.generation_flops(p, p, r, **shape)[0])
    assert gen > float(F.generation_flops(torch.tensor([4, 5]), p, r, **shape)[0])  # ours: one per prompt
    assert update == float(F.update_flops(p, r, **shape)[0])


def test_compare_trl_default_lr_is_one_our_module_takes():
    """The script's default lr (both policies stay put) passes our option ranges, which refuse lr 0."""
    import compare_trl

    from lit_rlvr.config.options import range_problems

    assert range_problems({"lr": float(compare_trl.DEFAULT_LR)}, "algorithm") == []
    assert range_problems({"lr": 0.0}, "algorithm")  # what the default was


def test_multi_turn_bench_runs_three_turns_and_reports_both_ratios(tmp_path):
    """bench/multi_turn.py on a smaller workload: it checks every rollout took its 3 turns and prints the budgets'
    keys (the figures themselves are measured, not tested)."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/multi_turn.py"), "--json", "--repeats", "1", "--warmup",
                           "0", "--turn-tokens", "4", "--sleep-ms", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"slow_over_instant", "overhead_frac", "instant_gen_s"} <= set(result) and result["turns"] == 3
    assert result["instant_gen_s"] > 0 and result["overhead_frac"] >= 0 and result["rollouts"] == 64


def test_compare_entries_carry_their_own_overrides():
    """`--compare grpo,grpo+model.lora.rank=8`: an entry's own overrides come after the shared ones."""
    import step_time

    assert step_time.entry("grpo", ["data.batch_size=4"]) == ("grpo", ["data.batch_size=4"])
    assert step_time.entry("grpo+model.lora.rank=8+model.lora.alpha=16", ["data.batch_size=4"]) == (
        "grpo", ["data.batch_size=4", "model.lora.rank=8", "model.lora.alpha=16"])


def test_flops_floor_scales_each_phase_by_its_flop_ratio():
    """GRPO: 2 s generation of 10 GFLOP, 1 s update of 30 GFLOP, 4 s step. An entry that generates 20% more FLOPs
    and updates as many would take 4 + 2·0.2 = 4.4 s at GRPO's rates: floor 1.1."""
    import step_time

    grpo = {"gen_s": 2.0, "train_s": 1.0, "gen_flops": 10e9, "update_flops": 30e9, "median_step_s": 4.0}
    c3po = {**grpo, "gen_flops": 12e9, "median_step_s": 4.6}
    assert math.isclose(step_time.flops_floor(grpo, c3po), 1.1)
    assert step_time.flops_floor(grpo, {**c3po, "gen_flops": None}) is None  # a model the count does not cover
