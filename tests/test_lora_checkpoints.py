"""LoRA checkpoints through `python train.py`: `checkpoints/last.ckpt` resumes exactly (metrics and adapter weights
identical for grpo and c3po), the adapter beside it in PEFT's format loads onto the base model with
`PeftModel.from_pretrained` with the trainer's log-probs, and `mode=eval checkpoint=<adapter dir>` evaluates it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_resume import _assert_same_steps, _start, _wait, train_rows

LORA = ["model.lora.rank=4", "data.num_test=8"]
PLANS = {"grpo": [], "c3po": []}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """Per algorithm: a 4-step run, and a 2-step run resumed to 4 in a fresh dir."""
    root = tmp_path_factory.mktemp("lora_resume")
    first = [_start(root / f"{algo}_{kind}", f"algorithm={algo}", f"trainer.max_steps={steps}", *LORA)
             for algo in PLANS for kind, steps in (("full", 4), ("part", 2))]
    for proc in first:
        _wait(proc, timeout=600)
    second = [_start(root / f"{algo}_resumed", f"algorithm={algo}", "trainer.max_steps=4", *LORA,
                     f"resume={root}/{algo}_part/checkpoints/last.ckpt") for algo in PLANS]
    for proc in second:
        _wait(proc, timeout=600)
    return root


def _adapter_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}


@pytest.mark.parametrize("algo", sorted(PLANS))
def test_lora_resume_is_exact(lora_runs, algo):
    full, resumed = lora_runs / f"{algo}_full", lora_runs / f"{algo}_resumed"
    rows_full, rows_resumed = train_rows(full / "metrics.csv"), train_rows(resumed / "metrics.csv")
    assert sorted(rows_resumed) == [2, 3]
    _assert_same_steps(rows_full, rows_resumed, range(2, 4))
    a, b = _adapter_weights(full / "checkpoints" / "last.ckpt"), _adapter_weights(resumed / "checkpoints" / "last.ckpt")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".lora_B." in k and bool(v.abs().sum() > 0) for k, v in a.items())  # trained: B moved off 0
    if algo == "c3po":  # 3PO's draws were over the adapters alone
        numel = sum(v.numel() for v in a.values())
        assert {float(r["noise/numel"]) for r in rows_full.values()} == {numel}


def test_adapter_loads_with_peft_onto_the_base_with_equal_logprobs(lora_runs, tiny_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from lit_rlvr.models import load_policy
    from lit_rlvr.module import GRPOModule
    from tiny_options import TINY

    adapter = lora_runs / "grpo_full" / "checkpoints" / "adapter"
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    trained = _adapter_weights(lora_runs / "grpo_full" / "checkpoints" / "last.ckpt")
    assert len(saved) == len(trained)  # the adapter alone, not the base
    base, tokenizer = load_policy(tiny_path)
    served = PeftModel.from_pretrained(base, str(adapter)).eval()
    module = GRPOModule(model="tiny", model_options=dict(TINY), lora={"rank": 4})
    state = torch.load(lora_runs / "grpo_full" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    module.load_state_dict(state["state_dict"], strict=False)
    ids = torch.tensor([tokenizer("12+34=46", add_special_tokens=False)["input_ids"],
                        tokenizer("71-18=53", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want = torch.log_softmax(module.policy.eval()(input_ids=ids).logits, -1)
        got = torch.log_softmax(served(input_ids=ids).logits, -1)
    assert torch.equal(got, want)
    with torch.no_grad(), served.disable_adapter():
        assert not torch.allclose(torch.log_softmax(served(input_ids=ids).logits, -1), want, atol=1e-4)


def test_mode_eval_takes_the_adapter_dir(lora_runs, tmp_path):
    run = lora_runs / "grpo_full"
    proc = _start(tmp_path / "eval", "mode=eval", f"checkpoint={run}/checkpoints/adapter", *LORA[1:])
    _wait(proc, timeout=600)
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert result["val/accuracy"] == summary["accuracy_after"]
    assert result["val/pass@k"] == summary["pass_at_k_after"]
