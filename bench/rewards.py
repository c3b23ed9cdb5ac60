"""The reward sources' two budgets (issue 43), each measured several times side by side, with the spread.

    python bench/rewards.py [--rounds 7] [--json]

1. A reward server at the default batch (8 prompts x 8 completions = 64 per call): the seconds one call of the
   `remote` runner takes against examples/reward_server.py on this machine, over the seconds the in-process runner
   takes for the same reward (`math`: math-verify on a \\boxed{} answer) on the same batch; rounds alternate.
   Budget: <= 1.10x.
2. 256 concurrent calls of an async reward that awaits 50 ms, under max_concurrent=256: the batch's wall time over
   one call's (50 ms). Budget: <= 2x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402,F401  (loaded before any clock starts)

from lit_rlvr.rewards import build_reward_runner  # noqa: E402
from lit_rlvr.rewards.async_runner import AsyncRewardRunner  # noqa: E402

BATCH = 64  # data.batch_size 8 x algorithm.group_size 8


async def wait_50ms(prompt, completion, answer):
    await asyncio.sleep(0.05)
    return 1.0


def _math_batch():
    prompts = [f"What is {i} + {i}?" for i in range(BATCH)]
    completions = [f"Adding them: {i} + {i} = {2 * i + i % 3}, so the answer is \\boxed{{{2 * i + i % 3}}}."
                   for i in range(BATCH)]
    return prompts, completions, [str(2 * i) for i in range(BATCH)]


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def remote_vs_in_process(rounds: int) -> dict:
    server = subprocess.Popen([sys.executable, str(ROOT / "examples" / "reward_server.py"), "--port", "0",
                               "--reward", "math"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        local = build_reward_runner("math", {"timeout_s": 60})
        remote = build_reward_runner("remote", {"url": url, "timeout_s": 60})
        batch = _math_batch()
        local(*batch), remote(*batch)  # warm: math-verify's first parse, the server's first request
        ratios, local_s, remote_s = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            a = local(*batch)
            t1 = time.perf_counter()
            b = remote(*batch)
            t2 = time.perf_counter()
            assert torch.equal(a.scores, b.scores), "the server and the in-process reward disagree"
            local_s.append(t1 - t0)
            remote_s.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
        local.close(), remote.close()
    finally:
        server.kill()
        server.wait()
    return {"ratio": _spread(ratios), "in_process_s": _spread(local_s), "remote_s": _spread(remote_s),
            "budget": 1.10}


def async_concurrency(rounds: int) -> dict:
    runner = AsyncRewardRunner(wait_50ms, max_concurrent=256, timeout_s=10)
    runner(["p"], ["c"], [None])  # the loop's thread starts
    walls = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        batch = runner(["p"] * 256, ["c"] * 256, [None] * 256)
        walls.append(time.perf_counter() - t0)
        assert batch.failures == 0
    runner.close()
    return {"ratio": _spread([w / 0.05 for w in walls]), "wall_s": _spread(walls), "budget": 2.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"remote_vs_in_process": remote_vs_in_process(args.rounds),
              "async_256x50ms": async_concurrency(args.rounds)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, r in result.items():
        ratio = r["ratio"]
        print(f"{name}: {ratio['median']:.3f}x (min {ratio['min']:.3f}, max {ratio['max']:.3f}, {ratio['runs']} "
              f"runs); budget {r['budget']}x")


if __name__ == "__main__":
    main()
