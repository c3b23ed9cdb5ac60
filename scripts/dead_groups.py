"""Dead groups at one checkpoint: what rescues them, weight noise or a hotter temperature? (the 3PO study)

A prompt is *dead* for a policy when its G completions at the mean weights (training temperature) are all wrong: its
GRPO advantages are all zero. For the prompts of a checkpoint's dead groups this script draws G more completions in
several arms and counts the prompts that get at least one correct answer ("rescued"):

    again       the mean weights at the same temperature, a second draw: what chance alone rescues
    T = t       the mean weights at a hotter temperature t (exploration in action space)
    λ = l       G/N completions from each of N IVON weight samples θ̂_j = m + σ⊙z_j, σ = 1/sqrt(λ(h0 + δ)),
                the posterior of a fresh IVON at the checkpoint (h = h0: what C3PO samples at its first step)

with each arm's malformed share (no readable answer). The same counting as `callbacks/dead_groups.py` (which runs
inside training on the step's prompts); here on many prompts of one checkpoint, so the counts are large enough for
intervals (Wilson 95 %). Every draw has its own seed; nothing is trained.

    python scripts/dead_groups.py --task arithmetic_cot                     # the reproduction's warm-up
    python scripts/dead_groups.py --model-dir ~/.cache/lit_rlvr/tiny-<key> --prompts 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from callbacks.dead_groups import any_correct  # noqa: E402
from callbacks.param_noise import sample_from_posterior  # noqa: E402
from lit_rlvr.models import load_policy  # noqa: E402
from lit_rlvr.rollout.warmup import WARMUP_TASKS, dev_problems, resolve_model_path  # noqa: E402
from lit_rlvr.optim import IVON  # noqa: E402
from lit_rlvr.rewards import build_reward_runner  # noqa: E402
from lit_rlvr.rollout.batch import RolloutPlan  # noqa: E402
from lit_rlvr.rollout.driver import RolloutDriver  # noqa: E402
from lit_rlvr.rollout.engine import SamplingConfig  # noqa: E402
from lit_rlvr.rollout.hf import HFEngine  # noqa: E402


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion hits/n (95 % by default); (nan, nan) when n = 0."""
    if n == 0:
        return math.nan, math.nan
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="arithmetic_cot",
                        help="a task of scripts/reproduce_settings.py: its pinned warm-up is the checkpoint")
    parser.add_argument("--model-dir", default=None, help="an HF directory to probe instead of the task's warm-up")
    parser.add_argument("--prompts", type=int, default=256, help="prompts of the warm-up's dev slice")
    parser.add_argument("--group-size", type=int, default=16, help="G")
    parser.add_argument("--temperature", type=float, default=1.0, help="the training temperature")
    parser.add_argument("--hot", default="1.1,1.2,1.3,1.5", help="hotter temperatures (comma-separated)")
    parser.add_argument("--ess", default="1e7,1e8,1e9,1e10", help="IVON λ values (comma-separated)")
    parser.add_argument("--num-samples", type=int, default=4, help="N weight samples per prompt's G")
    parser.add_argument("--hess-init", type=float, default=1e-3, help="IVON's h0 (the study's preset)")
    parser.add_argument("--weight-decay", type=float, default=1e-6, help="IVON's δ (the study's preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.group_size < 1 or args.num_samples < 1 or args.group_size % args.num_samples:
        parser.error("--prompts, --group-size, --num-samples must be >= 1 and --group-size a multiple of "
                     "--num-samples")
    return args


def task_model(task_name: str) -> tuple[str, dict]:
    """The task's warm-up directory and its options (as `train.py` resolves `model=tiny...` with them)."""
    from reproduce_settings import TASKS

    options = {}
    for override in TASKS[task_name].model:
        key, _, value = override.lstrip("+").partition("=")
        if key.startswith("model.options."):
            options[key.removeprefix("model.options.")] = json.loads(value) if value[:1] in "[0123456789" else value
    return resolve_model_path("tiny", options), options


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.model_dir:  # a warm-up's directory records its task, levels and completion budget
        record = Path(args.model_dir).expanduser() / "warmup.json"
        model_dir, options = args.model_dir, json.loads(record.read_text()) if record.exists() else {}
    else:
        model_dir, options = task_model(args.task)
    task_name = options.get("task", "arithmetic")  # (warm_start_tiny's default task)
    task_class, _ = WARMUP_TASKS[task_name]
    levels = tuple(options.get("levels", task_class.levels))
    problems = dev_problems(task_class(levels=levels, seed=0), args.prompts)
    model, tokenizer = load_policy(str(model_dir))
    model.eval()
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="shared")
    reward = build_reward_runner(task_name)
    max_new = int(options.get("max_new_tokens", 64))
    prompts = [p["prompt"] for p in problems]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    answers = [p["answer"] for p in problems]

    def draw(arm: str, index: int, temperature: float, ess: float | None = None):
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new)
        driver = RolloutDriver(engine, tokenizer, reward, sampling, policy=model)
        plan = RolloutPlan(prompts, answers, ids, [args.group_size] * len(prompts))
        if ess is not None:
            optimizer = IVON(model.parameters(), lr=1.0, ess=ess, hess_init=args.hess_init,
                             weight_decay=args.weight_decay, seed=args.seed)
            sample_from_posterior(plan, optimizer, args.num_samples)
        started = time.perf_counter()
        rollouts = driver.rollout(plan, step=0, seed_key=(args.seed, "dead-groups", index)).rollouts
        correct = any_correct(rollouts.rewards > 0, rollouts.group, len(prompts))  # [B]
        malformed = rollouts.malformed.float().mean() if rollouts.malformed is not None else torch.tensor(0.0)
        print(f"  {arm}: {time.perf_counter() - started:.0f} s", flush=True)
        return correct, float(malformed), float((rollouts.rewards > 0).float().mean())

    mean_correct, mean_malformed, mean_acc = draw("mean", 0, args.temperature)
    dead = ~mean_correct
    print(f"  dead at the mean: {int(dead.sum())} of {len(prompts)}", flush=True)
    arms = [("again", args.temperature, None)]
    arms += [(f"T = {t:g}", t, None) for t in map(float, args.hot.split(","))]
    arms += [(f"λ = {e:.0e}", args.temperature, e) for e in map(float, args.ess.split(","))]
    rows = [{"arm": "mean (defines dead)", "rescued": None, "n_dead": int(dead.sum()), "malformed": mean_malformed,
             "accuracy": mean_acc}]
    for index, (arm, temperature, ess) in enumerate(arms, start=1):
        correct, malformed, acc = draw(arm, index, temperature, ess)
        hits, n = int((correct & dead).sum()), int(dead.sum())
        low, high = wilson(hits, n)
        rows.append({"arm": arm, "temperature": temperature, "ess": ess, "rescued_count": hits, "n_dead": n,
                     "rescued": hits / n if n else math.nan, "ci95": [low, high], "malformed": malformed,
                     "accuracy": acc})
        print(f"  {arm}: rescued {hits} / {n} [{low:.3f}, {high:.3f}], malformed {malformed:.3f}", flush=True)
    print(f"\n{args.prompts} prompts × G = {args.group_size}; dead at the mean (T = {args.temperature:g}): "
          f"{int(dead.sum())} ({dead.float().mean():.3f}); model {model_dir}\n")
    print("| arm | rescued / dead | share [95 % CI] | malformed | accuracy of the arm's completions |")
    print("|---|---|---|---|---|")
    for r in rows:
        share = "—" if r["rescued"] is None else f"{r['rescued']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        count = "—" if r["rescued"] is None else f"{r['rescued_count']} / {r['n_dead']}"
        print(f"| {r['arm']} | {count} | {share} | {r['malformed']:.3f} | {r['accuracy']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "model_dir": str(model_dir), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
