"""Weight push into an `HFEngine` in `copy` mode against this machine's memcpy bandwidth (docs/architecture.md §9).

    python bench/weight_sync.py [--json] [--repeats 20] [--mb 100] [--workload long]
    python bench/weight_sync.py --engine sglang [--json]   # a live sglang.Engine on a CPU: weight_sync_sglang.py

Two models: the cached tiny model (~0.4 MB) and a synthetic Qwen3 of about `--mb` MB (random weights, built in
code). For each, `lit_rlvr.rollout.weights.push_weights` sends the weights to a `copy`-mode engine with several
bucket sizes, alternating, repeat by repeat, with a memcpy of the same total bytes (`dst.copy_(src)` between
two preallocated flat fp32 buffers, and tensor by tensor at the model's own shapes). Bandwidth = bytes /
median time. The headline (`push_bytes_per_s`, `memcpy_bytes_per_s`, `ratio`, budget ≥ 0.5) is the synthetic
model at the module's bucket size (256 MiB) with 2 threads (§9): the tiny model's 0.4 MB sit in cache and
its copies are too small to matter, so its figures (`tiny_*`) say little about bandwidth. `--workload long`
measures the long workload's model (~12.7 MB, `long_*`) instead, and the share of weight sync in its GRPO step
with a `copy`-mode engine (`long_sync_share` = median sync_s / median step, `--steps` steps after one warm-up).

`ratio_per_tensor_memcpy` compares the push with plain copies of the same tensors: it separates what
`push_weights` costs from what copying the model's separate tensors costs. The push and the flat memcpy are
also measured at 1 thread (`*_1_thread*`), alternating with the rest. With libgomp's default wait policy on
a loaded machine every 2-thread copy waited for its second thread to be scheduled (the push of 46 tensors
fell to ~0.1 of memcpy, measured); lit_rlvr bounds the OpenMP spin, see bench/README.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BUDGET = 0.5  # docs/architecture.md §9: push ≥ 50% of memcpy bandwidth
BUCKETS_MB = (1, 16, 256)  # 256 MiB is GRPOModule's default bucket_bytes
HEADLINE_BUCKET_MB = 256
ONE_THREAD_CASES = (f"push_{HEADLINE_BUCKET_MB}mb", "memcpy")


def synthetic_model(target_mb: float):
    """A Qwen3 causal LM of about `target_mb` MB of fp32 weights, randomly initialised."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers = 512, 4
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden  # attention (q, k, v, o) + MLP (gate, up, down)
    vocab = max(1024, int((target_mb * 2**20 / 4 - layers * per_layer) / hidden))
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=hidden // 8,
                         max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(model, repeats: int, threads: int) -> dict[str, float]:
    """Push bandwidths per bucket size and memcpy bandwidths for `model`'s bytes, alternated repeat by repeat."""
    import torch

    from lit_rlvr.rollout.hf import HFEngine
    from lit_rlvr.rollout.weights import push_weights

    engine = HFEngine(model, pad_id=0, eos_id=0, mode="copy")
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()  # flat buffers of the same bytes
    dst = torch.empty_like(src)
    shaped = [torch.empty_like(p) for p in params]

    def per_tensor():
        with torch.no_grad():
            for d, s in zip(shaped, params):
                d.copy_(s)

    cases = {f"push_{mb}mb": (lambda mb=mb: push_weights(engine, model, bucket_bytes=mb << 20)) for mb in BUCKETS_MB}
    cases.update(memcpy=lambda: dst.copy_(src), memcpy_per_tensor=per_tensor)
    # the same at 1 thread: on a loaded machine every 2-thread copy waits for its second thread to be scheduled
    cases.update({f"{name}@1": fn for name, fn in list(cases.items()) if name in ONE_THREAD_CASES})
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name, fn in cases.items():  # warm-up: first touch of every page, allocator, code paths
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            torch.set_num_threads(1 if name.endswith("@1") else threads)
            times[name].append(timed(fn))
    torch.set_num_threads(threads)
    engine_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    if engine_bytes != nbytes or not all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), params)):
        raise RuntimeError("the engine's weights differ from the model's after the pushes")
    out = {"bytes": nbytes, "tensors": len(params)}
    out.update({f"{name}_bytes_per_s": nbytes / common.median(ts) for name, ts in times.items()})
    return out


def run(args) -> dict:
    from lit_rlvr.models import load_policy

    workload = common.workload_overrides(args)
    small, _ = load_policy(common.model_path(common.compose("grpo", workload)), "float32")
    big = synthetic_model(args.mb)
    tiny_stats = measure(small, args.repeats * 10, args.threads)  # ≤ 13 MB: many more repeats cost little
    big_stats = measure(big, args.repeats, args.threads)
    head = big_stats[f"push_{HEADLINE_BUCKET_MB}mb_bytes_per_s"]
    result = {
        "push_bytes_per_s": head,
        "memcpy_bytes_per_s": big_stats["memcpy_bytes_per_s"],
        "ratio": head / big_stats["memcpy_bytes_per_s"],
        "budget": BUDGET,
        "model_bytes": big_stats["bytes"],
        "bucket_mb": HEADLINE_BUCKET_MB,
        "ratio_per_tensor_memcpy": head / big_stats["memcpy_per_tensor_bytes_per_s"],
    }
    for mb in BUCKETS_MB:
        result[f"ratio_bucket_{mb}mb"] = big_stats[f"push_{mb}mb_bytes_per_s"] / big_stats["memcpy_bytes_per_s"]
    push_1, memcpy_1 = big_stats[f"push_{HEADLINE_BUCKET_MB}mb@1_bytes_per_s"], big_stats["memcpy@1_bytes_per_s"]
    result.update(push_1_thread_bytes_per_s=push_1, memcpy_1_thread_bytes_per_s=memcpy_1,
                  ratio_1_thread=push_1 / memcpy_1)
    tiny_head = tiny_stats[f"push_{HEADLINE_BUCKET_MB}mb_bytes_per_s"]
    name = args.workload
    result.update({f"{name}_bytes": tiny_stats["bytes"], f"{name}_push_bytes_per_s": tiny_head,
                   f"{name}_memcpy_bytes_per_s": tiny_stats["memcpy_bytes_per_s"],
                   f"{name}_ratio": tiny_head / tiny_stats["memcpy_bytes_per_s"]}, repeats=args.repeats)
    if name != "tiny":  # what the push costs in a step of that workload, with an engine holding its own copy
        import step_time

        summaries, _ = step_time.measure(["grpo"], args.steps, 1, 1, [*workload, "engine.options.mode=copy"])
        step = summaries["grpo"]
        result.update({f"{name}_sync_s": step["sync_s"], f"{name}_step_s": step["median_step_s"],
                       f"{name}_sync_share": step["sync_s"] / step["median_step_s"],
                       **{f"{name}_{k}": step[k] for k in ("response_len_mean", "response_len_max", "padding_frac")
                          if k in step}})
    result.update(common.context())
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per case (tiny model: ×10)")
    parser.add_argument("--mb", type=float, default=100.0, help="size of the synthetic model in MB")
    parser.add_argument("--threads", type=int, default=common.THREADS, help="torch threads (the reference workload: 2)")
    parser.add_argument("--engine", choices=("hf", "sglang"), default="hf",
                        help="sglang: push into a live sglang.Engine (CPU venv of scripts/sglang_cpu_env.sh)")
    parser.add_argument("--steps", type=int, default=6,
                        help="--engine sglang or --workload long: GRPO steps per run for the sync share")
    parser.add_argument("--workload", choices=sorted(common.WORKLOADS), default="tiny",
                        help="whose model is measured beside the synthetic one (long, medium: and its step's sync "
                             "share)")
    parser.add_argument("--medium", action="append", default=[], metavar="KEY=VALUE",
                        help="--workload medium: change its shape (bench/medium.py)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.mb <= 0 or args.steps < 2:
        raise SystemExit("--repeats must be >= 1, --mb > 0 and --steps >= 2")
    common.quiet(args.threads)
    if args.engine == "sglang":
        import weight_sync_sglang

        common.emit(weight_sync_sglang.run(args), args.json)
        return
    common.emit(run(args), args.json)


if __name__ == "__main__":
    main()
