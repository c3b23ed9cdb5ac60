"""The roofline figure of `generation.py --workload medium --json` (docs/results/performance.md).

    python bench/plot_roofline.py RESULT.json [--out docs/results/roofline.png] [--title TEXT]

RESULT.json holds the JSON line generation.py prints. The roof is min(peak FLOP/s, bandwidth × intensity) of the
machine the result was taken on (`peak_flops`, `peak_bandwidth`); each engine's prefill and decode are a point:
x their model FLOPs per byte they must read (`prefill_flops` / `prefill_bytes`, `decode_flops` /
`decode_bytes`), y the FLOP/s they reached (over `first_token_latency_s`, and over the rest of the generation).
A point's height under the roof at its x is that phase's share of the bound, which `*_of_roofline` gives per step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASE_MARKERS = {"prefill": "s", "decode": "o"}


def points(result: dict) -> list[tuple[str, str, float, float]]:
    """(engine, phase, FLOPs per byte, FLOP/s) of each engine that ran."""
    out = []
    for name, engine in result["engines"].items():
        if "error" in engine:
            continue
        decode_s = engine["seconds"] - engine["first_token_latency_s"]
        out.append((name, "prefill", engine["prefill_flops"] / engine["prefill_bytes"],
                    engine["prefill_flops"] / engine["first_token_latency_s"]))
        out.append((name, "decode", engine["decode_flops"] / engine["decode_bytes"], engine["decode_flops"] / decode_s))
    return out


def plot(result: dict, out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    peak, bandwidth = result["peak_flops"], result["peak_bandwidth"]
    marks = points(result)
    xs = [x for _, _, x, _ in marks] + [peak / bandwidth]
    grid = np.logspace(np.log10(min(xs) / 4), np.log10(max(xs) * 4), 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(grid, np.minimum(peak, bandwidth * grid), "k-", lw=1.5,
              label=f"roof: {peak / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.0f} GB/s")
    colours = dict(zip(result["engines"], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for name, phase, x, y in marks:
        share = result["engines"][name][f"{phase}_of_roofline"]
        ax.loglog([x], [y], PHASE_MARKERS[phase], color=colours[name], ms=8,
                  label=f"{name} {phase}: {share:.2g} of roofline")
    ax.set_xlabel("model FLOPs per byte read")
    ax.set_ylabel("FLOP/s reached")
    ax.set_title(title or f"medium workload, {result.get('cpu', '')}, {result.get('threads', '?')} threads",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="the JSON line of generation.py --workload medium --json")
    parser.add_argument("--out", type=Path, default=Path("docs/results/roofline.png"))
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    lines = [line for line in args.result.read_text().splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
        result["engines"], result["peak_flops"], result["peak_bandwidth"]
    except (IndexError, ValueError, KeyError) as err:
        raise SystemExit(f"{args.result}: not the JSON of generation.py --workload medium --json ({err!r})") from None
    plot(result, args.out, args.title)
    print(args.out)


if __name__ == "__main__":
    main()
