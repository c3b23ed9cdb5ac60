"""The medium workload's machinery (bench/medium.py, generation.py --engines, compare_trl.py's roofline) at a
small scale: its JSON keys, equal work, and each figure against its roofline. Timings are never asserted beyond
their range (docs/architecture.md §9)."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# a few-hundred-kB Qwen3 of the workload's architecture (head_dim 32: vLLM's CPU attention needs ≥ 32)
SMALL = {"vocab": 512, "hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 32,
         "prompt_tokens": 16, "completion_tokens": 8}
SMALL_ARGS = [arg for key, value in SMALL.items() for arg in ("--medium", f"{key}={value}")]


def test_generation_medium_reports_each_engine_against_its_roofline(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench/generation.py"), "--workload", "medium", *SMALL_ARGS,
                           "--engines", "hf", "--repeats", "1", "--warmup", "1", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    hf = result["engines"]["hf"]
    for key in ("of_roofline", "mbu", "mfu", "tokens_per_s", "first_token_latency_s", "per_token_latency_s",
                "peak_rss_mb", "prefill_of_roofline", "decode_of_roofline", "decode_mbu"):
        assert hf[key] > 0, key
    assert 0 < hf["of_roofline"] <= 1.5 and 0 < hf["decode_of_roofline"] <= 1.5
    # 8 prompts × 8 completions, every one exactly completion_tokens long (ignore_eos)
    assert hf["tokens"] == 64 * SMALL["completion_tokens"]
    assert result["engines_work"]["equal_work"] and result["equal_work"]
    assert set(result["engines_work"]["sides"]) == {"workload", "hf"}
    assert result["shape"]["hidden"] == 64 and result["parameters"] > 0
    assert result["l3_bytes"] is None or result["weights_over_l3"] > 0
    assert result["best_engine"] == "hf" and result["peak_flops"] > 0 and result["peak_bandwidth"] > 0


def test_medium_model_is_what_its_shape_counts(tmp_path):
    import medium
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = medium.parse_shape([f"{k}={v}" for k, v in SMALL.items()])
    paths = medium.build(shape, str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    assert sum(p.numel() for p in model.parameters()) == medium.parameters(shape)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    row = json.loads(Path(paths["data"]).read_text().splitlines()[0])
    # the prompt's text is its ids: it tokenizes back to them, nothing added
    assert tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] == medium.prompt_ids(shape)[0]
    assert medium.build(shape, str(tmp_path)) == paths  # built once


@pytest.mark.parametrize("item, message", [("width=3", "KEY one of"), ("hidden=x", "integer"),
                                           ("layers=0", ">= 1"), ("vocab=2", "special tokens")])
def test_medium_shape_refuses_bad_items(item, message):
    import medium

    with pytest.raises(SystemExit, match=message):
        medium.parse_shape([item])


def test_medium_roofline_of_a_step_is_the_sum_of_its_phases():
    import compare_trl
    import medium

    shape = medium.parse_shape([f"{k}={v}" for k, v in SMALL.items()])
    args = Namespace(workload="medium", medium_shape=shape)
    ours = {"peak_flops": 1e11, "peak_bandwidth": 1e10}
    out = compare_trl.roofline_result(args, ours, {"median_step_s": 2.0, "gen_s": 0.5, "train_s": 1.0}, 4.0)
    bound = medium.workload_roofline(shape, peak_flops=1e11, peak_bandwidth=1e10)
    step = bound["prefill_bound_s"] + bound["decode_bound_s"] + bound["update_bound_s"]
    assert out["roofline_s"] == pytest.approx(step)
    assert out["ours_of_roofline"] == pytest.approx(step / 2.0) and out["trl_of_roofline"] == pytest.approx(step / 4)
    assert out["ours_update_of_roofline"] == pytest.approx(bound["update_bound_s"] / 1.0)
    # the update is compute-bound: its bound is its FLOPs over the peak
    assert bound["update_bound_s"] == pytest.approx(bound["update_flops"] / 1e11)
    assert compare_trl.roofline_result(Namespace(workload="tiny"), ours, {}, 1.0) == {}


def test_roofline_figure_places_each_phase(tmp_path):
    import plot_roofline

    engine = {"seconds": 3.0, "first_token_latency_s": 1.0, "prefill_flops": 4e9, "prefill_bytes": 1e8,
              "decode_flops": 2e9, "decode_bytes": 4e9, "prefill_of_roofline": 0.5, "decode_of_roofline": 0.25}
    result = {"peak_flops": 1e10, "peak_bandwidth": 1e9, "engines": {"hf": engine, "vllm_cpu": {"error": "no venv"}}}
    assert plot_roofline.points(result) == [("hf", "prefill", 40.0, 4e9), ("hf", "decode", 0.5, 1e9)]
    source, figure = tmp_path / "result.json", tmp_path / "roofline.png"
    source.write_text("a line an engine printed\n" + json.dumps(result) + "\n")
    plot_roofline.main([str(source), "--out", str(figure)])
    assert figure.stat().st_size > 10_000
