"""Step time of a GRPO run over two CPU rollout servers against the colocated HF engine at equal work, and the
trainer's wait in an asynchronous run over the servers (issue 60's budgets).

    VENV/bin/python bench/server_step.py --engine vllm|sglang [--steps 6] [--warmup 2] [--rounds 2] [--json]

VENV is the environment of scripts/vllm_cpu_env.sh or scripts/sglang_cpu_env.sh. Two servers are started with
`lit-rlvr-serve --engine ENGINE --model tiny_cot` on 127.0.0.1, each pinned to one core (`taskset`, every thread
of its process group: core 0 and core 1), and three `train.py` runs of the chain-of-thought task (`tiny_cot`,
8 prompts x 8 samples, up to 64 new tokens, one update a step) run in turns, `--rounds` times, the order rotated:

- `colocated`: `engine=hf` (the default colocated engine, in the trainer's process);
- `servers`: `engine=ENGINE_server` over both servers (pushes through `weight_transfer`'s default route);
- `servers_async`: the same with `rollout.mode=async rollout.max_staleness=1` (pushes in flight: each lands
  between two generation calls, the servers paused around it).

The trainer is not pinned (it runs beside the servers): on a 2-core machine the layout is oversubscribed (two
servers, a core each, plus the trainer's threads on the same two cores), so the servers' figures here are a lower
bound of what the layout gives on the machines it is meant for (servers on cores or GPUs of their own).

Reported per configuration: median seconds per step over the rounds' steps after `--warmup` (first steps
dropped), its phase split (`time/gen_s`, `time/reward_s`, `time/train_s`, `time/sync_s`), and the generated tokens
per step (the work: sampling differs between engines, so their step time per generated token is reported too);
`servers_over_colocated` = step(servers) / step(colocated) and `..._per_token` the same per generated token;
`trainer_wait_frac` = median `async/trainer_wait_frac` of `servers_async` (budget <= 0.10), with its rounds'
smallest and largest.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

WAIT_BUDGET = 0.10  # issue 60: async S = 1 over servers, trainer wait <= 10 %
RUN = ["data=arithmetic_cot", "data.batch_size=8", "algorithm.group_size=8", "algorithm.max_new_tokens=64",
       "data.num_test=8", "eval_before=false", "callbacks.progress=null"]
PHASES = ("time/step_s", "time/gen_s", "time/reward_s", "time/train_s", "time/sync_s", "async/trainer_wait_frac",
          "response/len_mean", "rollouts/per_step")


def pin(server, core: int) -> None:
    """Every thread of every process in `server`'s process group onto `core`."""
    group = os.getpgid(server.proc.pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == group:
                    subprocess.run(["taskset", "-a", "-cp", str(core), entry], capture_output=True, check=False)
            except ProcessLookupError:
                continue


def configs(engine: str, urls: str) -> dict[str, list[str]]:
    servers = [f"engine={engine}_server", urls]
    return {"colocated": ["engine=hf"], "servers": servers,
            "servers_async": [*servers, "rollout.mode=async", "rollout.max_staleness=1"]}


def train_rows(overrides: list[str], steps: int) -> list[dict[str, float]]:
    """The training rows of metrics.csv of one `train.py` run."""
    with tempfile.TemporaryDirectory(prefix="lit_rlvr_server_step_") as run_dir:
        cmd = [sys.executable, "train.py", *RUN, *overrides, f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        with (Path(run_dir) / "metrics.csv").open() as handle:
            rows = [r for r in csv.DictReader(handle) if r.get("time/step_s")]
    return [{k: float(v) for k, v in r.items() if k in PHASES and v not in ("", "nan")} for r in rows]


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {k.split("/", 1)[1]: common.median(r.get(k) for r in rows) for k in PHASES}
    out["tokens_per_step"] = common.median(r["response/len_mean"] * r["rollouts/per_step"] for r in rows
                                           if "response/len_mean" in r and "rollouts/per_step" in r)
    return out


def measure(args) -> dict:
    from tests.server_live import start_servers, urls

    logs = Path(tempfile.mkdtemp(prefix="lit_rlvr_server_step_"))
    servers = start_servers(args.engine, "tiny_cot", logs, 2)
    t_start = time.perf_counter()
    loads = []
    try:
        for core, server in enumerate(servers):
            pin(server, core % (os.cpu_count() or 1))
        sides = configs(args.engine, urls(servers))
        kept: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        per_round: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for round_index in range(args.rounds):
            for name in common.rotated(list(sides), round_index):
                rows = train_rows(sides[name], args.steps)[args.warmup:]
                kept[name] += rows
                per_round[name].append(summary(rows))
                loads.append(os.getloadavg()[0])
    finally:
        for server in servers:
            server.kill()
    result: dict = {"engine": args.engine, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    for name, rows in kept.items():
        result[name] = summary(rows)
        result[name]["step_s_rounds"] = [r["step_s"] for r in per_round[name]]
    col, srv = result["colocated"], result["servers"]
    result["servers_over_colocated"] = srv["step_s"] / col["step_s"]
    result["servers_over_colocated_per_token"] = (srv["step_s"] / srv["tokens_per_step"]) / (
        col["step_s"] / col["tokens_per_step"])
    waits = [r["trainer_wait_frac"] for r in per_round["servers_async"]]
    result.update(trainer_wait_frac=result["servers_async"]["trainer_wait_frac"], trainer_wait_frac_min=min(waits),
                  trainer_wait_frac_max=max(waits), wait_budget=WAIT_BUDGET,
                  oversubscribed=(os.cpu_count() or 1) < 3, loadavg_1m_during=loads,
                  bench_s=time.perf_counter() - t_start,
                  **common.context())
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run dropped")
    parser.add_argument("--rounds", type=int, default=2, help="runs per configuration, the order rotated")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not 0 <= args.warmup < args.steps:
        raise SystemExit("--rounds must be >= 1 and 0 <= --warmup < --steps")
    common.quiet()
    common.emit(measure(args), args.json)


if __name__ == "__main__":
    main()
