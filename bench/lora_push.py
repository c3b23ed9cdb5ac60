"""Weight-push bytes per step with LoRA adapters against full weights (budget: adapters <= 2% at rank 32 for the
qwen3_4b config; docs/architecture.md §9).

    python bench/lora_push.py [--json] [--rank 32]

`qwen3_4b`: counted from the parameter shapes of a meta-device model (no weights), in bf16 as the engine holds
them. `tiny` and `long`: the workloads' own models, measured: a `copy`-mode engine records the bytes each push
sends (fp32), for `lora_sync=adapter` and `merged` against a full-weight push.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BUDGET = 0.02


def counted_4b(rank: int) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM

    from lit_rlvr.config.settings import LoraOptions

    from lit_rlvr.models.lora import apply_lora
    from lit_rlvr.models.reference_configs import qwen3_4b_config
    from lit_rlvr.rollout.lora import push_bytes

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_4b_config())
    full = push_bytes(model, lora_sync="adapter", first=False, dtype=torch.bfloat16)
    lora = apply_lora(model, LoraOptions(rank=rank))
    adapter = push_bytes(lora, lora_sync="adapter", first=False, dtype=torch.bfloat16)
    merged = push_bytes(lora, lora_sync="merged", first=False, dtype=torch.bfloat16)
    return {"full_bytes": full, "adapter_bytes": adapter, "merged_bytes": merged, "adapter_frac": adapter / full,
            "merged_frac": merged / full, "budget": BUDGET}


def measured(workload: str, rank: int) -> dict:
    """Bytes of the second push (a training step's) of the workload's model, per sync mode, against full."""
    from omegaconf import OmegaConf

    from lit_rlvr.module import GRPOModule

    cfg = common.compose("grpo", [f"{k}={v}" for k, v in common.WORKLOADS[workload].items()])
    options = OmegaConf.to_container(cfg.model.options, resolve=True)
    out = {}
    for label, lora, sync in (("full", None, "adapter"), ("adapter", {"rank": rank}, "adapter"),
                              ("merged", {"rank": rank}, "merged")):
        engine_options = {"mode": "copy", "lora_sync": sync, "sync_check_every": 0}  # the bytes alone
        module = GRPOModule(model=cfg.model.name_or_path, model_options=options, lora=lora,
                            engine_options=engine_options)
        module.setup("fit")
        module.driver.push(step=0)  # the first push (full weights where needed)
        out[f"{label}_bytes"] = module.driver.push(step=1).nbytes
    out["adapter_frac"] = out["adapter_bytes"] / out["full_bytes"]
    out["merged_frac"] = out["merged_bytes"] / out["full_bytes"]
    return out


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--workloads", default="tiny,long", help="measured models (empty: the 4B count only)")
    args = parser.parse_args(argv)
    common.quiet()
    result = {"rank": args.rank, "qwen3_4b": counted_4b(args.rank)}
    for name in filter(None, args.workloads.split(",")):
        result[name] = measured(name, args.rank)
    result.update(common.context())
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
