"""Issue 42, hostile inputs (LoRA): every adapter kind is sampled exactly by C3PO's stacked call (or refused
before any work), a misspelt target is refused naming it, and the Lightning CLI writes the adapter as train.py
does. Unit-level on a freshly built tiny model (no warm-up), one 1-step CLI run on a saved copy of it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.settings import LoraOptions
from lit_rlvr.models.lora import apply_lora, lora_layers, model_problems
from lit_rlvr.models.tiny import build_tiny, save
from lit_rlvr.rollout.lora import adapter_tensors, merged_named_weights
from lit_rlvr.rollout.multi_weight import stacked_weights

N = 3  # weight samples
REPO = Path(__file__).resolve().parents[1]


def lora_tiny(targets) -> nn.Module:
    """The tiny architecture (random init) with adapters on `targets`, B ≠ 0 (a trained adapter)."""
    model, _ = build_tiny()
    with warnings.catch_warnings():  # peft: a tied embedding in the adapter
        warnings.simplefilter("ignore")
        model = apply_lora(model, LoraOptions(rank=4, target_modules=targets)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def gpt2_lora(targets) -> nn.Module:
    """A one-layer GPT-2 (transformers' Conv1D linear layers) with adapters on `targets`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return apply_lora(model, LoraOptions(rank=2, target_modules=targets)).eval()


def sample_stacks(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {p: p.detach() + 0.3 * torch.randn((N, *p.shape), generator=gen)
            for p in model.parameters() if p.requires_grad}


KINDS = {  # adapter kind -> (model builder, targets)
    "embedding": (lora_tiny, ("embed_tokens",)),
    "embedding+linear": (lora_tiny, ("embed_tokens", "q_proj")),  # the reported case
    "linear": (lora_tiny, ("q_proj", "down_proj")),
    "lm_head": (lora_tiny, ("lm_head",)),
    "all-linear": (lora_tiny, "all-linear"),
    "conv1d+embedding": (gpt2_lora, ("c_attn", "wte")),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stacked_sampling_equals_per_sample_forwards_for_every_adapter_kind(kind):
    build, targets = KINDS[kind]
    model = build(targets)
    stacks = sample_stacks(model)
    ids = torch.randint(4, 40, (N * 2, 6), generator=torch.Generator().manual_seed(3))  # block n: rows 2n, 2n+1
    with torch.no_grad():
        with stacked_weights(model, stacks):
            got = model(input_ids=ids, use_cache=False).logits  # [N·2, 6, V]
        want, mean = [], model(input_ids=ids, use_cache=False).logits
        for n in range(N):
            saved = [(p, p.detach().clone()) for p in stacks]
            for p, stack in stacks.items():
                p.copy_(stack[n])
            want.append(model(input_ids=ids[2 * n: 2 * n + 2], use_cache=False).logits)
            for p, value in saved:
                p.copy_(value)
    want = torch.cat(want)
    assert not torch.allclose(mean, want, atol=1e-3)  # the samples differ from the mean: the test can see it
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # batched kernels: equal to rounding


def test_c3po_stacked_generation_with_an_embedding_adapter_equals_per_sample_calls():
    """The reported case end to end: C3PO's one decoding call (HF engine, shared) over N sampled adapters on
    embed_tokens and q_proj gives each block the tokens and log-probs of a call with that sample loaded."""
    from lit_rlvr.models.tiny import build_tokenizer
    from lit_rlvr.rollout.engine import SamplingParams
    from lit_rlvr.rollout.hf import HFEngine

    model, tokenizer = lora_tiny(("embed_tokens", "q_proj")), build_tokenizer()
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_batch=4)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "5+5=", "71-18=")]
    counts = [[2, 1, 0], [1, 1, 1], [0, 2, 1]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=70 + s, ignore_eos=True) for s in range(N)]
    stacks = sample_stacks(model)
    got = engine.generate_stacked(ids, counts, params, stacks)
    with torch.no_grad():
        for n in range(N):
            saved = [(p, p.detach().clone()) for p in stacks]
            for p, stack in stacks.items():
                p.copy_(stack[n])
            want = engine.generate(ids, counts[n], params[n])
            for p, value in saved:
                p.copy_(value)
            for got_b, want_b in zip(got[n], want):
                for g, w in zip(got_b, want_b):
                    assert torch.equal(g.token_ids, w.token_ids)
                    torch.testing.assert_close(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)


def test_a_stacked_parameter_read_by_a_module_with_stacked_children_is_refused():
    """A module whose parameters sit in a ParameterDict runs per block; a stacked child below it would split
    the block's rows again: refused, not computed wrong."""
    model = lora_tiny(("embed_tokens",))
    stacks = sample_stacks(model)
    base = next(m for _, m in lora_layers(model)).base_layer.weight
    stacks[base] = base.detach().expand(N, *base.shape).clone()
    with pytest.raises(ValueError, match="only one of them can run per block"), stacked_weights(model, stacks):
        pass


@pytest.mark.parametrize("kind", ["embedding+linear", "conv1d+embedding"])
def test_merged_push_merges_every_adapter_kind(kind):
    """`lora_sync=merged`: W + ΔW for each adapted layer in W's layout (peft's own delta as the reference);
    before, embedding adapters were left out and Conv1D deltas had the Linear layout."""
    build, targets = KINDS[kind]
    model = build(targets)
    merged = dict(merged_named_weights(model, adapted_only=True))
    layers = dict(lora_layers(model))
    assert len(merged) == len(layers) and any(hasattr(layer, "lora_embedding_A") and layer.lora_embedding_A
                                              for layer in layers.values())
    for name, layer in layers.items():
        want = layer.base_layer.weight + layer.get_delta_weight("default")
        torch.testing.assert_close(merged[name.removeprefix("base_model.model.") + ".weight"], want)


def test_pushed_adapter_keys_are_peft_file_keys():
    """The adapter tensors pushed to an engine carry the keys of adapter_model.safetensors (embedding too)."""
    from peft import get_peft_model_state_dict

    model = lora_tiny(("embed_tokens", "q_proj"))
    assert set(adapter_tensors(model)) == set(get_peft_model_state_dict(model, save_embedding_layers=False))


# -- targets: each names a module that an adapter may sit on, checked before any work ------------------------------
def test_a_misspelt_target_is_refused_naming_it_and_the_valid_names():
    problems = model_problems(LoraOptions(rank=4, target_modules=("q_proj", "v_prj")), "tiny")
    assert problems == ["model.lora.target_modules: 'v_prj' names no module of this model; valid: down_proj, "
                        "embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"]


@pytest.mark.parametrize("target, kind", [("norm", "Qwen3RMSNorm"), ("self_attn", "Qwen3Attention"),
                                          ("layers", "ModuleList")])
def test_a_target_no_adapter_may_sit_on_is_refused(target, kind):
    (line,) = model_problems(LoraOptions(rank=4, target_modules=(target,)), "tiny")
    assert line.startswith(f"model.lora.target_modules: {target!r} names a {kind} module; adapters sit on layers "
                           "of the kinds Linear, Embedding, Conv1D only; valid: down_proj, ")


def test_a_conv_or_attention_adapter_is_refused_on_the_loaded_model():
    """peft adapts nn.Conv2d and nn.MultiheadAttention too; their adapters stacked sampling and merged pushes
    would not compute: refused with the key, the module and the kinds allowed."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.attn = nn.MultiheadAttention(4, 1)
            self.proj = nn.Linear(4, 4)

    for target, kind in (("conv", "Conv2d"), ("attn", "MultiheadAttention")):
        expected = f"'{target}' names a {kind} module; adapters sit on .* valid: out_proj, proj$"
        with pytest.raises(ValueError, match=expected):
            apply_lora(Net(), LoraOptions(rank=2, target_modules=(target, "proj")))


def test_valid_targets_pass():
    for targets in (("q_proj", "v_proj"), ("self_attn.q_proj",), ("embed_tokens", "lm_head"), "all-linear"):
        assert model_problems(LoraOptions(rank=4, target_modules=targets), "tiny") == []


def test_the_module_refuses_a_misspelt_target_before_the_warm_up(monkeypatch):
    """GRPOModule (Python, the Lightning CLI): before the tiny model's warm-up or any load."""
    import lit_rlvr.rollout.warmup as warmup
    from lit_rlvr.module import GRPOModule

    monkeypatch.setattr(warmup, "warm_start_tiny", lambda *a, **k: pytest.fail("warm-up started"))
    with pytest.raises(ConfigError, match=r"^model\.lora\.target_modules: 'v_prj' names no module"):
        GRPOModule(model="tiny", lora={"rank": 4, "target_modules": ["q_proj", "v_prj"]})


def test_the_module_refuses_it_for_a_model_directory_before_loading(tmp_path, monkeypatch):
    import lit_rlvr.module as module_file

    path = save(*build_tiny(), tmp_path / "model")
    monkeypatch.setattr(module_file, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="'v_prj' names no module of this model; valid: down_proj"):
        module_file.GRPOModule(model=str(path), lora={"rank": 4, "target_modules": ["q_proj", "v_prj"]})


def test_the_cli_names_its_own_key():
    from lit_rlvr.app.cli import cli_keys

    (line,) = model_problems(LoraOptions(rank=4, target_modules=("v_prj",)), "tiny")
    assert cli_keys(line).startswith("model.init_args.model.lora.target_modules: 'v_prj' names no module")


def test_train_py_config_check_refuses_a_misspelt_target():
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.config_check import check_config

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_prj]"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: 'v_prj' names no module"):
        check_config(cfg)


# -- the Lightning CLI writes the adapter as train.py does -----------------------------------------------------
def test_the_cli_writes_the_adapter_beside_its_checkpoint(tmp_path):
    """`lit-rlvr fit ... --model.init_args.model.lora '{rank: 4}'`: checkpoints/adapter/ in PEFT's format, loadable onto
    the base, beside last.ckpt (the CLI's ModelCheckpoint), as train.py's RunCheckpoint writes it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lit_rlvr.app.cli import main
    from lit_rlvr.models.adapter_export import adapter_state

    base = save(*build_tiny(), tmp_path / "model")  # no warm-up: any HF directory serves
    run = tmp_path / "run"
    main(["fit", "--config", str(REPO / "conf" / "cli" / "tiny_grpo.yaml"), "--model.init_args.model.name_or_path",
          str(base), "--model.init_args.model.lora", "{rank: 4}", "--model.init_args.algorithm.group_size", "2",
          "--data.batch_size", "2",
          "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(run)])
    folder = run / "checkpoints"
    assert (folder / "last.ckpt").is_file()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (folder / "adapter").iterdir()}
    state = torch.load(folder / "last.ckpt", weights_only=False)["state_dict"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder / "adapter")
    for name, tensor in adapter_state(loaded):
        assert torch.equal(tensor, state["policy." + name]), name  # the checkpoint's adapter, bit for bit


# -- a merged push cannot change one use of a tied weight -------------------------------------------------------
@pytest.mark.parametrize("target, tied", [("lm_head", "model.embed_tokens.weight"),
                                          ("embed_tokens", "lm_head.weight")])
def test_a_merged_push_refuses_an_adapter_on_a_tied_weight(target, tied):
    """The tiny model ties lm_head to embed_tokens: W + ΔW pushed under one name would change both uses (an
    lm_head adapter crashed the push; an embedding adapter silently moved the engine's output head too)."""
    from lit_rlvr.rollout.hf import HFEngine
    from lit_rlvr.rollout.lora import merged_push_problems

    model = lora_tiny((target, "q_proj"))
    for options, refused in (({"mode": "copy", "lora_sync": "merged"}, True), ({"mode": "shared"}, False),
                             ({"mode": "copy", "lora_sync": "adapter"}, False)):
        engine = HFEngine(model, pad_id=0, eos_id=2, **options)
        problems = merged_push_problems(engine, model)
        assert problems == ([f"model.lora.target_modules: {target!r} adapts a weight tied to {tied}, which a merged "
                             "push (engine.options.lora_sync=merged) cannot change alone; use engine=hf with "
                             "engine.options.mode=shared, or leave it out of the targets"] if refused else [])
