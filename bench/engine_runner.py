"""One engine generating the medium workload, timed; run by bench/generation.py with the engine's own Python.

    PYTHON bench/engine_runner.py SPEC.json OUT.json     # writes one JSON object to OUT.json

vLLM and SGLang live in environments of their own (scripts/vllm_cpu_env.sh, scripts/sglang_cpu_env.sh; their
torch builds differ from the project's), so generation.py runs this script with `$VLLM_VENV/bin/python` or
`$SGLANG_VENV/bin/python`, and `hf` (lit-rlvr's `HFEngine`) with its own Python, in a process of its own too:
every engine is timed and its memory measured the same way. This file imports only the engine it runs (and the
standard library), so it runs in any of the three environments.

SPEC: {"engine": "hf" | "vllm" | "sglang", "model": folder, "prompts": [[ids]], "group": G, "max_new_tokens": T,
"temperature", "seed", "dtype", "device", "threads", "warmup", "repeats", "kv_cache_bytes"}. Each round generates
the batch twice: with 1 new token (the prefill and the first sample: `first_token_s`) and with T (`full_s`); every
completion runs to T (`ignore_eos`). The result: per round `first_token_s`, `full_s`; each completion's length of
the last full round (`lengths`); the engine's version; and memory: `peak_rss_mb`, the peak RSS (VmHWM) of this
process and every process under it (vLLM's engine core, SGLang's scheduler) summed, read before the engine
shuts down: an upper bound on what they held at once.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_hf(spec: dict):
    """lit-rlvr's HFEngine as the trainer runs it (shared prefill, row cuts, in-place KV cache)."""
    import torch

    from lit_rlvr.models import load_policy
    from lit_rlvr.rollout.engine import SamplingParams
    from lit_rlvr.rollout.hf import HFEngine

    torch.set_num_threads(spec["threads"])
    model, tokenizer = load_policy(spec["model"], spec["dtype"])
    model = model.to(spec["device"]).eval()
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)

    def generate(max_new_tokens: int) -> list[int]:
        params = SamplingParams(temperature=spec["temperature"], max_new_tokens=max_new_tokens, seed=spec["seed"],
                                ignore_eos=True)
        out = engine.generate(spec["prompts"], [spec["group"]] * len(spec["prompts"]), params)
        if spec["device"] != "cpu":
            torch.cuda.synchronize()
        return [len(c.token_ids) for cs in out for c in cs]

    return generate, lambda: None, "transformers " + __import__("transformers").__version__


def run_vllm(spec: dict):
    """vllm.LLM on token ids: n = G samples of each prompt (its prefix cache shares their prefill)."""
    import vllm

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], seed=spec["seed"],
                  max_model_len=spec["max_model_len"], enforce_eager=spec["device"] == "cpu")
    if spec["device"] == "cpu":
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    llm = vllm.LLM(**kwargs)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    def generate(max_new_tokens: int) -> list[int]:
        params = vllm.SamplingParams(n=spec["group"], temperature=spec["temperature"], max_tokens=max_new_tokens,
                                     min_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
        out = llm.generate(prompts, params, use_tqdm=False)
        return [len(c.token_ids) for request in out for c in request.outputs]

    return generate, lambda: None, "vllm " + vllm.__version__


def run_sglang(spec: dict):
    """sglang.Engine on token ids: each prompt sent G times in one call (its radix cache may share the prefill)."""
    if spec["device"] == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # before sglang loads: its CPU platform
    import sglang

    server = {"device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch",
              "disable_cuda_graph": True, "enable_memory_saver": False, "base_gpu_id": 0,
              "max_total_tokens": spec["max_total_tokens"]} if spec["device"] == "cpu" else {}
    engine = sglang.Engine(model_path=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
                           random_seed=spec["seed"], mem_fraction_static=spec.get("mem_fraction_static", 0.3),
                           context_length=spec["max_model_len"], log_level="error", **server)
    rows = [ids for ids in spec["prompts"] for _ in range(spec["group"])]

    def generate(max_new_tokens: int) -> list[int]:
        # no min_new_tokens: sglang refuses it without a tokenizer; ignore_eos alone runs every row to the end
        params = {"temperature": spec["temperature"], "max_new_tokens": max_new_tokens, "ignore_eos": True}
        out = engine.generate(input_ids=rows, sampling_params=params)
        return [len(o["output_ids"]) for o in out]

    return generate, engine.shutdown, "sglang " + sglang.__version__


RUNNERS = {"hf": run_hf, "vllm": run_vllm, "sglang": run_sglang}


def tree_peak_rss_mb(root: int) -> float:
    """Σ VmHWM of `root` and its descendants (from /proc), in MB."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0.0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0) / 1024
        except OSError:
            continue
    return total


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: PYTHON bench/engine_runner.py SPEC.json OUT.json")
    with open(argv[0]) as f:
        spec = json.load(f)
    if spec.get("engine") not in RUNNERS:
        raise SystemExit(f"{argv[0]}: engine {spec.get('engine')!r} is not one of {', '.join(RUNNERS)}")
    t0 = time.perf_counter()
    generate, close, version = RUNNERS[spec["engine"]](spec)
    start_s = time.perf_counter() - t0
    first, full, lengths = [], [], []
    try:
        for i in range(spec["warmup"] + spec["repeats"]):
            t0 = time.perf_counter()
            generate(1)
            t1 = time.perf_counter()
            lengths = generate(spec["max_new_tokens"])
            t2 = time.perf_counter()
            if i >= spec["warmup"]:
                first.append(t1 - t0)
                full.append(t2 - t1)
        memory = tree_peak_rss_mb(os.getpid())
    finally:
        close()
    result = {"engine": spec["engine"], "version": version, "start_s": start_s, "first_token_s": first,
              "full_s": full, "lengths": lengths, "peak_rss_mb": memory}
    # a file, not stdout (the engines print their own lines there), written aside and renamed: whole or absent,
    # so the caller may stop waiting for an engine whose shutdown hangs once it is there (vLLM's CPU workers)
    with open(f"{argv[1]}.tmp", "w") as f:
        json.dump(result, f)
    os.replace(f"{argv[1]}.tmp", argv[1])


if __name__ == "__main__":
    main()
