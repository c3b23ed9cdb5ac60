"""`lit-rlvr-serve`: start a rollout server, vLLM's or SGLang's own, with what a lit-rlvr run's weight updates need
(docs/scaling.md, "Rollout servers"), for `engine=vllm_server` / `engine=sglang_server`:

    lit-rlvr-serve --engine vllm --model tiny_cot --port 8101 [--host 127.0.0.1] [ENGINE FLAGS...]

`--model` is a Hugging Face folder (or hub name) or a built-in model preset (`conf/model/NAME.yaml`, e.g. `tiny_cot`):
a preset of the built-in tiny model is warmed up (or taken from the run's cache, `LIT_RLVR_CACHE`) exactly as
`train.py` would for the same preset and data, and served from that folder, so the run's model check passes.
Flags it does not know go to the engine unchanged (they win over its defaults). The server replaces this process
(same pid: stopping it stops the server); `--dry-run` prints the command instead. It listens on 127.0.0.1 unless
`--host` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.app.entry import compose_checked
from lit_rlvr.rollout.warmup import resolve_model_path
from lit_rlvr.run.one_line import one_line_errors

ENGINES = ("vllm", "sglang")
VLLM_WORKER = "lit_rlvr.rollout.vllm_server_worker.ServerWorker"
VLLM_FILE_BACKEND = "lit_rlvr_file"
# on a CPU: no compilation, a KV cache of fixed size (vLLM would reserve most of the host's memory otherwise)
VLLM_CPU = {"--enforce-eager": None, "--kv-cache-memory-bytes": str(256 << 20)}
# SGLang on a CPU: the settings of conf/engine/sglang_cpu.yaml (docs/scaling.md), but a static share of 0.6: sglang
# checks it against the host memory still free after the model loads, which other processes move (0.2 was refused
# on a shared machine); the KV pool itself is capped by --max-total-tokens
SGLANG_CPU = {"--device": "cpu", "--attention-backend": "torch_native", "--sampling-backend": "pytorch",
              "--disable-cuda-graph": None, "--mem-fraction-static": "0.6", "--max-total-tokens": "65536"}


def preset_names() -> list[str]:
    """The built-in model presets: conf/model/*.yaml."""
    folder = importlib.resources.files("lit_rlvr.conf").joinpath("model")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_data(name: str) -> Optional[str]:
    """The data config that selects model preset `name` (`override /model@model: NAME`), if one does: the preset's
    settings read that task's (the warm-up's levels), so the served folder is the one the run warms up."""
    folder = importlib.resources.files("lit_rlvr.conf").joinpath("data")
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml") and f"override /model@model: {name}\n" in path.read_text():
            return path.name.removesuffix(".yaml")
    return None


def model_folder(model: str, overrides: Sequence[str] = ()) -> str:
    """`--model` as the folder (or hub name) to serve: an existing path as is; a preset resolved as `train.py`
    resolves it (the tiny model warmed up or read from the cache)."""
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser().resolve())
    presets = preset_names()
    if model not in presets:
        if model.startswith((".", "/", "~")):
            raise ConfigError([f"--model {model}: no such folder; give an HF model folder or a preset: "
                               f"{', '.join(presets)}"])
        return model  # a hub name: the engine fetches it
    data = preset_data(model)
    cfg = compose_checked(None, [f"model={model}", *([f"data={data}"] if data else []), *overrides])
    options = OmegaConf.to_container(cfg.model.get("options") or {}, resolve=True)
    return resolve_model_path(str(cfg.model.name_or_path), options)


def folder_dtype(folder: str) -> str:
    """The dtype a local model folder's config names (`dtype`, or the older `torch_dtype`); `auto` otherwise."""
    config = Path(folder, "config.json")
    if not config.is_file():
        return "auto"
    values = json.loads(config.read_text())
    return str(values.get("dtype") or values.get("torch_dtype") or "auto")


def _flag_names(args: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def _with_defaults(defaults: dict[str, Optional[str]], extra: Sequence[str]) -> list[str]:
    """`defaults` as flags, except those the user's `extra` flags set, then `extra`."""
    given, out = _flag_names(extra), []
    for flag, value in defaults.items():
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out + list(extra)


def server_command(engine: str, folder: str, *, host: str, port: int, seed: int, cpu: bool,
                   extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) of the engine's server for `folder`. It generates in the dtype of the folder's
    config (vLLM's `auto` would pick bfloat16 on a CPU for a float32 model, which the trainer's check refuses)."""
    dtype = folder_dtype(folder)
    if engine == "vllm":
        defaults: dict[str, Optional[str]] = {
            "--host": host, "--port": str(port), "--seed": str(seed), "--dtype": dtype,
            "--logprobs-mode": "processed_logprobs",  # log softmax(logits / T) of the sampled token
            "--worker-extension-cls": VLLM_WORKER,
            "--weight-transfer-config": json.dumps({"backend": VLLM_FILE_BACKEND}),
            "--enable-scale-out": None,  # /inference/v1/generate: token ids in and out
            **(VLLM_CPU if cpu else {}),
        }
        # VLLM_SERVER_DEV_MODE: the weight-update routes (/pause, /start_weight_update, ...) and /reset_prefix_cache
        # `vllm serve` itself: vllm-cpu's `vllm` command looks up the distribution "vllm" for --version and fails
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", folder,
                *_with_defaults(defaults, extra)], {"VLLM_SERVER_DEV_MODE": "1"}
    defaults = {
        "--model-path": folder, "--host": host, "--port": str(port), "--random-seed": str(seed), "--dtype": dtype,
        "--skip-tokenizer-init": None,  # token ids in and out
        **(SGLANG_CPU if cpu else {}),
    }
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {}
    return [sys.executable, "-m", "sglang.launch_server", *_with_defaults(defaults, extra)], env


def parse(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="lit-rlvr-serve", description=__doc__.split("\n\n")[0],
                                     epilog="Other flags go to the engine's server unchanged.")
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--model", required=True, help="an HF model folder or hub name, or a preset: "
                        + ", ".join(preset_names()))
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on (default: loopback only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU, else the CPU settings")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a train.py override the preset's settings read (e.g. data.levels=[1,2]); repeatable")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args, extra = parser.parse_known_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: allowed: 1-65535")
    return args, extra


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console script `lit-rlvr-serve`."""
    args, extra = parse(argv)
    with one_line_errors():
        folder = model_folder(args.model, args.override)
        cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        command, env = server_command(args.engine, folder, host=args.host, port=args.port, seed=args.seed, cpu=cpu,
                                      extra=extra)
    line = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command)
    print(line.strip(), flush=True)
    if args.dry_run:
        return
    os.execve(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    main()
