"""How far training moved a run's policy from the model it started from: the relative L2 norm of the weight change
and the mean per-weight |change|, from the run's `checkpoints/last.ckpt` (IVON: its mean weights; LoRA: the merged
change (α/r)·B·A of every adapted layer) against the starting model's safetensors.

    python scripts/weight_change.py ~/.cache/lit_rlvr/tiny-<key> runs/reproduce/arithmetic_cot/grpo_g16/seed0 ...

Used to match step sizes across optimizers in the reproduction's pilots (docs/results/reproduction_cot.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def weight_change(start: dict[str, torch.Tensor], checkpoint: dict) -> dict[str, torch.Tensor]:
    """{HF weight name: change} of the weights the run trained."""
    state = checkpoint["state_dict"]
    settings = checkpoint["hyper_parameters"]
    lora = settings.get("lora") or (settings.get("model") or {}).get("lora") or {}  # (model.lora since the settings)
    scale = lora.get("alpha", 32.0) / lora["rank"] if lora.get("rank") else 0.0
    change = {}
    for key, value in state.items():
        name = key.removeprefix("policy.").replace("base_model.model.", "")
        if ".lora_A." in name:
            b = state[key.replace("lora_A", "lora_B")].float()
            change[name.split(".lora_A.")[0] + ".weight"] = scale * (b @ value.float())
        elif ".lora_" not in name:
            name = name.replace(".base_layer", "")
            if name in start and name not in change:
                change[name] = value.float() - start[name].float()
    return {name: delta for name, delta in change.items() if name in start}


def main() -> None:
    from safetensors.torch import load_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("start", help="the starting model's directory (its model.safetensors)")
    parser.add_argument("runs", nargs="+", help="run directories (each with checkpoints/last.ckpt)")
    args = parser.parse_args()
    start = load_file(str(Path(args.start).expanduser() / "model.safetensors"))
    for run in args.runs:
        checkpoint = torch.load(Path(run) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        change = weight_change(start, checkpoint)
        squared = sum(float(d.pow(2).sum()) for d in change.values())
        norm = sum(float(start[n].float().pow(2).sum()) for n in change)
        count = sum(d.numel() for d in change.values())
        mean_abs = sum(float(d.abs().sum()) for d in change.values()) / max(count, 1)
        print(f"{run}: relative L2 change {(squared / norm) ** 0.5:.2e}, mean |Δw| {mean_abs:.2e}")


if __name__ == "__main__":
    main()
