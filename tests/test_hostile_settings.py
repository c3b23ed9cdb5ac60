"""Hostile settings (issue 42, third round): every check fires before any work, from train.py's config check, the
Python constructors and the Lightning CLI, with one line naming the key, the value and what is allowed.

* bounds of the rollout correction that exclude the on-policy value (every token masked, loss 0) are refused,
  and an update that masks every loss token stops the run naming the settings;
* a non-finite float is refused for every setting, at any depth, unless inf means something for that key;
* keys that no code reads (`+model.lora_rank=8`) are refused, with a close match;
* a value that does not convert names the key (never a bare `invalid literal for int()`).
"""

from __future__ import annotations

from dataclasses import replace

import math
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.seed import isolate_rng

from lit_rlvr.app.cli import main as cli_main
from lit_rlvr.app.config_check import check_config
from lit_rlvr.app.entry import compose_checked
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import convert, range_problems
from lit_rlvr.config.settings import LoraOptions
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.config.rollout_correction import RolloutCorrection

REPO = Path(__file__).resolve().parents[1]
RC = "algorithm.rollout_correction"


def _compose(*overrides: str):
    return compose_checked(str(REPO / "conf"), overrides)  # Hydra's refusals of the typed settings: our lines


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        check_config(_compose(*overrides))
    return err.value.problems


# -- 8: bounds that exclude the on-policy value ------------------------------------------------------------------
@pytest.mark.parametrize("rs, threshold", [
    ("token", "0.5"), ("sequence", "0.9"), ("geometric", "0.99"),  # one number C < 1: [1/C, C] is empty
    ("token_k1", "'1.1_3'"), ("seq_sum_k1", "'0.2_0.9'"), ("seq_mean_k1", "'1.01_1.02'"),  # "lower_upper" past 1
    ("token,geometric", "'0.5_2,1.5_3'"), ("token_k1,seq_mean_k3", "'1.2_2.0,0.01'"),  # one of several
    # k2/k3 accept their on-policy value 0 below any bound > 0, but not a non-finite one (strings: not floats)
    ("token_k2", "'nan'"), ("token_k1,seq_max_k3", "'2,inf'"),
])
def test_rejection_bounds_that_exclude_the_on_policy_value_are_refused(rs, threshold):
    problems = _problems(f"{RC}.rollout_rs='{rs}'", f"{RC}.rollout_rs_threshold={threshold}")
    assert len(problems) == 1 and problems[0].startswith(f"{RC}.rollout_rs_threshold="), problems
    assert f"rollout_rs={rs!r}" in problems[0]


@pytest.mark.parametrize("rs, threshold", [
    ("token", "2.0"), ("sequence", "1.0"), ("token_k1", "'0.5_1'"), ("seq_max_k2", "0.001"), ("seq_mean_k3", "1e-6"),
    ("token_k1,seq_mean_k3", "'0.5_2.0,0.01'"),
])
def test_rejection_bounds_around_the_on_policy_value_pass(rs, threshold):
    check_config(_compose(f"{RC}.rollout_rs='{rs}'", f"{RC}.rollout_rs_threshold={threshold}"))


@pytest.mark.parametrize("threshold", ["0.5", "'0.5_0.9'", "'1.5_3'"])
def test_is_bounds_below_or_above_one_are_refused(threshold):
    problems = _problems(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold={threshold}")
    assert len(problems) == 1 and problems[0].startswith(f"{RC}.rollout_is_threshold="), problems


def test_an_inherited_rejection_bound_is_named_as_inherited():
    """rollout_rs_threshold null takes rollout_is_threshold: the line says so."""
    (line,) = _problems(f"{RC}.rollout_rs=token", f"{RC}.rollout_is_threshold=0.5")
    assert "(null: rollout_is_threshold's)" in line


def test_the_constructor_refuses_the_same_bounds():
    with pytest.raises(ValueError, match=r"rollout_rs_threshold=0\.5 for rollout_rs='token'.*excludes 1"):
        RolloutCorrection.from_options({"rollout_rs": "token", "rollout_rs_threshold": 0.5})


@pytest.fixture(scope="module")
def tiny_module(tiny_path):
    from lit_rlvr.module import GRPOModule
    from tiny_options import TINY

    cache = os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")
    return GRPOModule(model="tiny", model_options={"cache_dir": cache, **TINY}, group_size=4, max_new_tokens=6)


def _masked_update(module, shift: float, **options) -> None:
    """One update on 8 completions whose engine log-probs are `shift` nats per token below the policy's (no
    trainer: plain autograd, an optimizer at lr 0)."""
    from lit_rlvr.config.rollout_correction import RolloutCorrection
    from lit_rlvr.rollout.batch import Rollouts
    from lit_rlvr.update import forward_logprobs

    g = torch.Generator().manual_seed(0)
    n, p, t = 8, 5, 6
    rollouts = Rollouts(
        prompt_ids=torch.randint(4, 90, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (n, t), generator=g),
        response_mask=torch.arange(t) < torch.tensor([1, 6, 3, 4, 2, 5, 6, 3])[:, None],
        old_logp=torch.zeros(n, t), group=torch.arange(n) // 4, source=torch.zeros(n, dtype=torch.long),
        num_groups=2, prompts=["a", "b"], answers=[0, 0], advantages=torch.randn(n, generator=g))
    with torch.no_grad():
        logp, _ = forward_logprobs(module.policy, rollouts, temperature=module.algorithm.temperature)  # [n, t]
    rollouts.old_logp = (logp - shift) * rollouts.response_mask
    module.algorithm = replace(module.algorithm, rollout_correction=RolloutCorrection(**options))
    module.make_update(torch.optim.SGD(module.policy.parameters(), lr=0.0)).run(rollouts)


def test_an_update_that_masks_every_token_stops_the_run_naming_the_settings(tiny_module):
    """Valid bounds, but an engine 1 nat per token away: every token's ratio e ≈ 2.7 leaves [1/1.5, 1.5]."""
    from lit_rlvr.config.errors import MaskedStepError

    with pytest.raises(MaskedStepError) as err:
        _masked_update(tiny_module, 1.0, rollout_rs="token", rollout_rs_threshold=1.5, bypass_mode=True)
    (line,) = err.value.problems
    assert "every one of the 30 loss tokens was masked" in line
    assert f"{RC}.rollout_rs='token' rollout_rs_threshold=1.5" in line
    _masked_update(tiny_module, 0.0, rollout_rs="token", rollout_rs_threshold=1.5, bypass_mode=True)  # on-policy


def test_the_all_masked_stop_catches_the_sequence_mask_too(tiny_module):

    from lit_rlvr.config.errors import MaskedStepError

    unmasked = tiny_module.algorithm
    tiny_module.algorithm = replace(unmasked, seq_mask_tau=2.0)
    try:
        with pytest.raises(MaskedStepError, match=r"algorithm\.seq_mask_tau=2\.0"):
            _masked_update(tiny_module, 1.0)  # every sequence's ratio is e^length >= e > 2
    finally:
        tiny_module.algorithm = unmasked


# -- 9: non-finite values ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    ["model.lora.alpha=inf"], ["model.lora.dropout=nan"], ["model.lora.lr_scale=inf"], ["algorithm.lr=nan"],
    ["algorithm.eps_high=inf"], ["+algorithm.betas=[0.9,inf]"], ["model.options.target=nan"], ["perf.peak_flops=inf"],
    ["engine.options.sync_check_tol=inf"], ["+trainer.gradient_clip_val=nan"], [f"{RC}.rollout_is_threshold=nan"],
    ["algorithm=c3po", "algorithm.optimizer_options.ess=inf"],
    ["algorithm=v05", "algorithm.callbacks.value_prior.cost=nan"],
    ["algorithm=v05", "algorithm.callbacks.value_prior.reward_range=[-1,inf]"],
    ["reward=math", "reward.options.format_weight=-inf"],
])
def test_non_finite_floats_are_refused_everywhere(overrides):
    problems = _problems(*overrides)
    key = overrides[-1].split("=")[0].lstrip("+")
    assert len(problems) == 1 and problems[0].startswith(key) and "finite" in problems[0], problems


def test_inf_where_it_means_no_bound_passes():
    check_config(_compose("algorithm=c3po", "algorithm.optimizer_options.clip_radius=inf"))


def test_constructors_refuse_non_finite_values():
    with pytest.raises(ConfigError, match=r"^model\.lora\.alpha=inf is not valid: expected a finite number$"):
        LoraOptions(rank=8, alpha=math.inf)
    assert range_problems({"lr": math.nan, "betas": (0.9, math.inf)}, "algorithm") == [
        "algorithm.lr=nan is not valid: expected a finite number",
        "algorithm.betas.1=inf is not valid: expected a finite number"]
    from callbacks.value_prior import ValuePrior

    with pytest.raises(ConfigError, match=r"algorithm\.callbacks\.value_prior\.cost=nan"):
        ValuePrior(cost=math.nan)


def test_the_module_refuses_a_non_finite_nested_option_before_the_model_loads(monkeypatch):
    from lit_rlvr import module as module_file
    from lit_rlvr.module import GRPOModule

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(module_file, "load_model", no_load)
    with pytest.raises(ConfigError, match=r"algorithm\.optimizer_options\.ess=inf"):
        GRPOModule(optimizer="ivon", optimizer_options={"ess": math.inf}, grad_clip=0.0)
    with pytest.raises(ConfigError, match=r"engine\.options\.sync_check_tol=nan"):
        GRPOModule(engine_options={"sync_check_tol": math.nan})


# -- 11: unknown keys ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, start, suggestion", [
    ("+model.lora_rank=8", "model.lora_rank is not an option", "model.lora.rank"),
    ("+model.lora.rnak=8", "model.lora.rnak is not an option (did you mean model.lora.rank?)", None),
    ("+model.options.warmup=3", "model.options.warmup is not an option", "model.options.warmup_steps"),
    ("+algorithm.learning_rate=1e-3", "algorithm.learning_rate is not an option", None),
    ("+algorithm.group_sise=4", "algorithm.group_sise is not an option", "algorithm.group_size"),
    ("+data.batchsize=4", "data.batchsize is not an option", "data.batch_size"),
    ("+perf.peak=1e12", "perf.peak is not an option", None),
    ("+trainer.max_step=3", "trainer.max_step is not an option", "trainer.max_steps"),
    ("+engine.options.max_btach=3", "engine.options.max_btach is not an option", "engine.options.max_batch"),
    ("+seeds=3", "seeds is not an option", "seed"),
])
def test_unknown_keys_are_refused_with_a_close_match(override, start, suggestion):
    problems = _problems(override)
    assert len(problems) == 1 and problems[0].startswith(start), problems
    if suggestion:
        assert f"did you mean {suggestion}?" in problems[0]


@pytest.mark.parametrize("overrides, start, suggestion", [  # without `+`: Hydra's "Could not override" before
    (["data.batchsize=4"], "data.batchsize is not an option", "data.batch_size"),
    (["trainer.max_stepz=3"], "trainer.max_stepz is not an option", "trainer.max_steps"),
    (["data=jsonl", "data.path=x.jsonl", "algorithm.max_new_tokens=8", "data.num_test=2"],
     "data.num_test is not an option", None),  # a key of the generated tasks' data config, not of a file's
])
def test_an_override_of_a_key_the_group_lacks_is_one_line(overrides, start, suggestion):
    problems = _problems(*overrides)
    assert len(problems) == 1 and problems[0].startswith(start) and "; valid: " in problems[0], problems
    if suggestion:
        assert f"did you mean {suggestion}?" in problems[0]


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_outside_numpys_range_names_the_key(seed):
    problems = _problems(f"seed={seed}")  # Lightning's seed_everything would say "-1 is not in bounds" alone
    expected = "is not valid: expected an integer in [0, 4294967295] (numpy's seed range)"
    assert sorted(problems) == [f"data.seed={seed} {expected}", f"seed={seed} {expected}"]
    check_config(_compose("seed=4294967295"))


@pytest.mark.parametrize("override, line", [
    ("trainer.devices=-3", "trainer.devices=-3 is not valid: expected an integer >= 1, -1 (all), 'auto', or a list"),
    ("trainer.devices=0", "trainer.devices=0 is not valid"),  # Lightning: a TypeError traceback once built
    ("trainer.devices=[-1]", "trainer.devices=[-1] is not valid"),
    ("engine.options.share_prefill=3", "engine.options.share_prefill=3 is not valid: expected true or false"),
    ("engine.options.use_cache=2", "engine.options.use_cache=2 is not valid: expected true or false"),
    ("algorithm.group_size=100000000000", "algorithm.group_size=100000000000 is not valid: expected an integer in "
                                          "[1, 65536]"),  # the run sat past SIGTERM in a loop over its samples
])
def test_values_lightning_or_the_engine_refused_only_once_built(override, line):
    problems = _problems(override)
    assert len(problems) == 1 and problems[0].startswith(line), problems


@pytest.mark.parametrize("devices", ["1", "auto", "-1", "[0]", "'0,1'"])
def test_lightnings_device_forms_pass(devices):
    check_config(_compose(f"trainer.devices={devices}"))


@pytest.mark.parametrize("overrides", [["algorithm=dapo"], ["data=arithmetic_cot"], ["env=calculator"],
                                       ["algorithm=c3po_v05"], ["engine=vllm"],
                                       ["data=jsonl", "data.path=x.jsonl", "algorithm.max_new_tokens=8"]])  # (tiny)
def test_keys_that_hydra_and_the_shipped_configs_add_pass(overrides):
    check_config(_compose(*overrides))


# -- 12: conversions name the key --------------------------------------------------------------------------------
@pytest.mark.parametrize("override, line", [
    ("model.lora.rank=abc", "model.lora.rank='abc' is not valid: expected an integer or null"),  # Hydra's schema
    ("model.lora.alpha=abc", "model.lora.alpha='abc' is not valid: expected a number"),
    ("engine.options.max_batch=abc", "engine.options.max_batch='abc' is not valid: expected an integer"),
    ("engine.options.sync_check_every=x", "engine.options.sync_check_every='x' is not valid: expected an integer"),
    ("model.options.target=abc", "model.options.target='abc' is not valid: expected a number"),
    ("perf.peak_flops=abc", "perf.peak_flops='abc' is not valid: expected a number or null"),
])
def test_a_value_that_does_not_convert_names_key_value_and_type(override, line):
    problems = _problems(override)
    assert len(problems) == 1 and problems[0].startswith(line), problems


def test_dapo_config_is_typed_as_grpo_modules_arguments():
    """algorithm=dapo builds GRPOModule: its arguments are typed."""
    assert _problems("algorithm=dapo", "algorithm.lr=abc") == ["algorithm.lr='abc' is not valid: expected a number"]


def test_constructors_convert_through_the_one_helper():
    from lit_rlvr.rewards.base import RewardRunner
    from lit_rlvr.rollout.lora import SyncCheck

    with pytest.raises(ConfigError, match=r"^model\.lora\.rank='abc' is not valid: expected an integer >= 1"):
        LoraOptions(rank="abc")
    assert LoraOptions(rank="8", alpha="16").rank == 8
    with pytest.raises(ConfigError, match=r"^engine\.options\.sync_check_every='x' is not valid"):
        SyncCheck.take_from({"sync_check_every": "x"})
    with pytest.raises(ConfigError, match=r"^reward\.options\.timeout_s='soon' is not valid: expected a number"):
        RewardRunner(lambda *a: 1.0, timeout_s="soon")
    assert convert("k", "3", int) == 3 and convert("k", 3.0, int) == 3 and convert("k", "1e-3", float) == 1e-3
    for value, kind in ((True, int), ("2.5", int), ("x", float), ("yes", bool), (math.inf, float)):
        with pytest.raises(ConfigError, match=r"^k="):
            convert("k", value, kind)


# -- the Lightning CLI: the same lines, in its key names -----------------------------------------------------------
def test_the_cli_refuses_the_same_settings_with_its_key_names(tmp_path, capsys, monkeypatch):
    """In this process (the entry point's own process is tests/test_cli.py's): its exit code and stderr line. A
    case that parses seeds the global RNGs and sets Lightning's seed variables: isolated from later tests."""
    monkeypatch.chdir(REPO)
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # recorded, so that teardown restores them as they were
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    command = ["fit", "--config", str(REPO / "conf" / "cli" / "tiny_grpo.yaml"), "--trainer.logger.init_args.save_dir",
               str(tmp_path)]
    cases = {
        "--model.init_args.model.lora={rank: 8, alpha: .inf}": "model.init_args.model.lora.alpha=inf is not valid: "
                                                                 "expected a finite number",
        "--model.init_args.model.lora={rank: abc}": "model.init_args.model.lora.rank is not valid: expected an integer",
        "--model.init_args.algorithm.lr=abc": "model.init_args.algorithm.lr=abc is not valid: expected a number",
        "--model.init_args.algorithm.lrr=1": "model.init_args.algorithm.lrr is not an option",
        "--model.init_args.algorithm.rollout_correction={rollout_rs: token, rollout_rs_threshold: 0.5}":
            "model.init_args.algorithm.rollout_correction.rollout_rs_threshold=0.5 for rollout_rs='token'",
    }
    for arg, expected in cases.items():
        with pytest.raises(SystemExit) as done, isolate_rng():
            cli_main([*command, arg])
        stderr = capsys.readouterr().err
        lines = [line for line in stderr.splitlines() if line.startswith("config error: ")]
        assert done.value.code == 2 and len(lines) == 1 and expected in lines[0], (arg, stderr[-2000:])


@pytest.mark.parametrize("override, line", [
    ("engine.options.max_batch=0", "engine.options.max_batch=0 is not valid: expected an integer >= 1"),
    ("++engine.options.sync_check_every=-1", "engine.options.sync_check_every=-1 is not valid: expected an integer"),
    ("++engine.options.sync_check_tol=-1", "engine.options.sync_check_tol=-1 is not valid: expected a number > 0"),
])
def test_engine_options_out_of_range_are_refused_before_any_work(override, line):
    """The adversary round: these reached the engine after the model loaded (a traceback, or `range()`'s error)."""
    with pytest.raises(ConfigError) as caught:
        check_config(_compose(override))
    assert caught.value.problems[0].startswith(line), caught.value.problems


def test_the_engine_refuses_a_batch_cap_of_zero_in_one_line():
    model, _ = build_tiny(0)
    with pytest.raises(ConfigError, match=r"^engine.options.max_batch=0 is not valid"):
        HFEngine(model, pad_id=0, eos_id=1, max_batch=0)


def test_an_override_hydras_grammar_cannot_read_is_one_line_naming_its_key_not_its_value(capsys):
    """An unquoted URL with `?k=v` (issue 61, adversary round 6): Hydra's four lines named no override; one line
    naming the key, before Hydra composes or writes anything, and without the value (it may hold a token)."""
    from lit_rlvr.app.entry import check_command_line, unparsable_overrides

    bad = "reward.options.url=http://127.0.0.1:5018/get_reward?api_key=s3cr3tQ"
    assert unparsable_overrides(["trainer.max_steps=2", 'reward.options.url="http://h/x?a=1"']) == []
    (line,) = unparsable_overrides(["trainer.max_steps=2", bad])
    assert line.startswith("the override of reward.options.url cannot be read (mismatched input '='")
    with pytest.raises(SystemExit) as stop:
        check_command_line(argv=[bad])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "s3cr3tQ" not in err
    assert [x for x in err.splitlines() if x.startswith("config error:")] == [f"config error: {line}"]
