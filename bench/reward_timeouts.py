"""What a reward timeout costs under `isolation=process` (issue 19, point 5): batches in which half the calls hang.

    python bench/reward_timeouts.py [--timeout 2] [--workers 2] [--batch 16] [--batches 3]

Each batch has `--batch` calls, every other one hanging (`time.sleep`, only a kill stops it). The bound alone
costs `hangs × timeout / workers` seconds per batch; the rest is what replacing the killed workers costs. The
first call (the worker process importing the reward's module) is timed apart: it is paid once per run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_rlvr.rewards.workers import ProcessRewardRunner  # noqa: E402
from tests.reward_helpers import echo_reward  # noqa: E402  ("hang" sleeps; anything else returns at once)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    with ProcessRewardRunner(echo_reward, timeout_s=args.timeout, workers=args.workers, score_bound=1e9) as runner:
        t0 = time.monotonic()
        runner(["p"] * args.workers, ["ok"] * args.workers, [0] * args.workers)
        print(f"first call (workers start): {time.monotonic() - t0:.2f} s")
        for i in range(args.batches):
            completions = ["hang" if k % 2 == 0 else "ok" for k in range(args.batch)]
            t0 = time.monotonic()
            batch = runner(["p"] * args.batch, completions, [0] * args.batch)
            seconds, bound = time.monotonic() - t0, batch.failures * args.timeout / args.workers
            print(f"batch {i}: {seconds:.2f} s for {batch.failures} timeouts; the bound alone {bound:.1f} s; "
                  f"overhead per timeout {(seconds - bound) / max(batch.failures, 1) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
