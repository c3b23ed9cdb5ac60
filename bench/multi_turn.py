"""Multi-turn rollouts: does a slow tool serialise the batch, and what does the turn loop itself cost?

64 rollouts (8 prompts x 8) of exactly 3 model turns each (`ignore_eos`, `--turn-tokens` tokens a turn) with the
HF engine, through `lit_rlvr.rollout.multi_turn.MultiTurn`; the environment calls a tool after turns 1 and 2 that
sleeps `--sleep-ms` (slow) or returns at once (instant), then ends the episode. The two variants run in rounds,
each first in turn (`common.rotated`), so both see the same load.
  * `slow_over_instant`: wall time with the sleeping tool over the instant one (budget <= 1.3: the 64 calls of a
    turn overlap, so a turn waits ~one sleep, not 64);
  * `overhead_frac`: with the instant tool, the loop's own time (wall - the engine's generate calls) over the
    generation time (budget <= 0.10): decoding turns, environment threads, observation tokens, the next contexts.
The model has the long workload's shape (4 layers x 256, the chain-of-thought vocabulary), randomly initialised:
timing does not depend on the weights.
"""

from __future__ import annotations

import time

from common import context, emit, median, quiet, rotated, rounds_parser

PROMPTS, SAMPLES, TURNS = 8, 8, 3


class ToolEnv:
    """Calls a tool (a sleep) after each of the first TURNS - 1 turns, then ends the episode."""

    def __init__(self, sleep_s: float):
        self.sleep_s, self.turns = sleep_s, 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str):
        self.turns += 1
        if self.turns >= TURNS:
            return {"observations": "", "reward": 1.0, "done": True, "metadata": {}}
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"observations": "=4042\n", "reward": 0.0, "done": False, "metadata": {"tool_call": True}}


def build(turn_tokens: int):
    import torch

    from lit_rlvr.models.tiny import build_tiny
    from lit_rlvr.rollout.engine import SamplingParams
    from lit_rlvr.rollout.hf import HFEngine

    model, tokenizer = build_tiny(0, hidden_size=256, layers=4)
    model.eval()
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    prompts = [f"{17 * i + 23}*{i + 3}=" for i in range(PROMPTS)]
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=turn_tokens, ignore_eos=True, seed=0)
    torch.manual_seed(0)
    return engine, tokenizer, prompts, ids, params


def one_round(variant: str, sleep_s: float, engine, tokenizer, prompts, ids, params) -> dict[str, float]:
    from lit_rlvr.envs import Environment
    from lit_rlvr.rollout.multi_turn import MultiTurn

    delay = sleep_s if variant == "slow" else 0.0
    env = Environment(make=lambda extras: ToolEnv(delay), max_turns=TURNS, max_tokens=10_000, timeout_s=60.0)
    gen = [0.0]

    def generate(p, n, sp):
        started = time.perf_counter()
        try:
            return engine.generate(p, n, sp)
        finally:
            gen[0] += time.perf_counter() - started

    started = time.perf_counter()
    episodes = MultiTurn(env, tokenizer).run(generate, ids, prompts, [0] * len(prompts), [SAMPLES] * len(prompts),
                                             params)
    wall = time.perf_counter() - started
    turns = [sum(role == "assistant" for role, _ in e.transcript.turns) for e in episodes]
    if len(episodes) != PROMPTS * SAMPLES or set(turns) != {TURNS}:
        raise SystemExit(f"expected {PROMPTS * SAMPLES} rollouts of {TURNS} turns, got turns {sorted(set(turns))}")
    return {"wall_s": wall, "gen_s": gen[0]}


def main(argv=None) -> None:
    parser = rounds_parser(__doc__.splitlines()[0], "timed rounds (each runs both variants)")
    parser.add_argument("--turn-tokens", type=int, default=48, help="tokens per model turn")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="the slow tool's sleep per call")
    args = parser.parse_args(argv)
    quiet(args.threads)
    parts = build(args.turn_tokens)
    rounds: dict[str, list[dict[str, float]]] = {"slow": [], "instant": []}
    ratios = []
    for r in range(args.warmup + args.repeats):
        this = {v: one_round(v, args.sleep_ms / 1000, *parts) for v in rotated(["slow", "instant"], r)}
        if r >= args.warmup:
            for v, m in this.items():
                rounds[v].append(m)
            ratios.append(this["slow"]["wall_s"] / this["instant"]["wall_s"])
    instant = rounds["instant"]
    overhead = [(m["wall_s"] - m["gen_s"]) / m["gen_s"] for m in instant]
    result = {
        "slow_over_instant": median(ratios), "slow_over_instant_min": min(ratios),
        "slow_over_instant_max": max(ratios),
        "overhead_frac": median(overhead), "overhead_frac_min": min(overhead), "overhead_frac_max": max(overhead),
        "slow_wall_s": median(m["wall_s"] for m in rounds["slow"]),
        "instant_wall_s": median(m["wall_s"] for m in instant), "instant_gen_s": median(m["gen_s"] for m in instant),
        "rollouts": PROMPTS * SAMPLES, "turns": TURNS, "turn_tokens": args.turn_tokens, "sleep_ms": args.sleep_ms,
        "repeats": args.repeats, **context(),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
