"""Hostile and careless environments and env settings (issue 42): copies per instance, the reward contract on
environment rewards, bounded observations, settings checked before any work, one-line errors, built-in defaults
from every entry point."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.envs import Environment, TextEnv, build_environment, environment_spec
from lit_rlvr.models.tiny import build_tokenizer
from lit_rlvr.rollout.engine import Completion, SamplingParams
from lit_rlvr.rollout.multi_turn import MultiTurn
from tiny_options import REPO


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def fake_generate(tokenizer, text="7"):
    """An engine that answers `text` (finished) to every context: no model needed to drive the loop."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(contexts, counts, params):
        return [[Completion(torch.tensor(ids), torch.zeros(len(ids)), "stop") for _ in range(n)] for n in counts]
    return generate


def run(env: Environment, tokenizer, answers=(0,), n=4, prompts=None):
    prompts = list(prompts or [f"p{b}" for b in range(len(answers))])
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    loop = MultiTurn(env, tokenizer)
    episodes = loop.run(fake_generate(tokenizer), ids, prompts, list(answers), [n] * len(prompts), SamplingParams())
    return loop, episodes


class OneStepEnv(TextEnv):
    """Done after one step with `env_config["reward"]` as its reward (the value itself, whatever it is)."""

    def step(self, action):
        return {"observations": "", "reward": self.env_config["value"], "done": True, "metadata": {}}


def one_step(value, **kwargs) -> Environment:
    return Environment(make=lambda extras: OneStepEnv({"value": value}, extras), name="one-step", **kwargs)


# -- class 3: every environment instance gets its own copy of what it is given ---------------------------------
class GreedyEnv(TextEnv):
    """Edits everything it was given, then reports what it saw."""

    seen: list = []

    def step(self, action):
        GreedyEnv.seen.append((list(self.answer), list(self.env_config["shared"]), dict(self.extras["extra"])))
        self.answer.append("mine")
        self.env_config["shared"].append("mine")
        self.extras["extra"]["touched"] = True
        return {"observations": "", "reward": 1.0, "done": True, "metadata": {}}


def test_each_environment_edits_only_its_own_answer_options_and_extras(tokenizer):
    GreedyEnv.seen = []
    env = build_environment(GreedyEnv, {"options": {"shared": [1]}})
    env = Environment(make=env.make, name="greedy", extras={"extra": {"k": 1}})
    answers = [[1, 2]]
    _, episodes = run(env, tokenizer, answers=answers, n=4)
    assert all(not e.malformed for e in episodes)
    assert GreedyEnv.seen == [([1, 2], [1], {"k": 1})] * 4  # no rollout saw another's edits
    assert answers == [[1, 2]] and env.extras == {"extra": {"k": 1}}  # nor does the data row, or the next step


# -- class 4: an environment's reward follows the reward functions' contract ------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e9, "1.0", None, [1.0], 10**400, 1 + 2j])
def test_an_environment_reward_that_is_not_a_score_is_malformed_and_counted(value, tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        _, episodes = run(one_step(value), tokenizer, n=2)
    for e in episodes:
        assert e.malformed and e.reward == -1.0 and e.transcript.reward_error and e.transcript.error is None
    assert any("scored as malformed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value, score", [(True, 1.0), (0, 0.0), (0.5, 0.5), (-1e6, -1e6)])
def test_an_environment_reward_that_is_a_score_counts(value, score, tokenizer):
    _, episodes = run(one_step(value), tokenizer, n=2)
    assert [(e.reward, e.malformed, e.transcript.reward_error) for e in episodes] == [(score, False, None)] * 2


def test_an_environment_reward_result_keeps_its_malformed_flag(tokenizer):
    from lit_rlvr.rewards.base import RewardResult

    _, episodes = run(one_step(RewardResult(-1.0, True)), tokenizer, n=1)
    assert episodes[0].malformed and episodes[0].reward == -1.0 and episodes[0].transcript.reward_error is None


def test_the_driver_counts_broken_environment_rewards_as_reward_failures():
    from lit_rlvr.models.tiny import build_tiny
    from lit_rlvr.rewards.base import RewardRunner
    from lit_rlvr.rollout.batch import RolloutPlan
    from lit_rlvr.rollout.driver import RolloutDriver
    from lit_rlvr.rollout.engine import SamplingConfig
    from lit_rlvr.rollout.hf import HFEngine

    model, tok = build_tiny(0)
    engine = HFEngine(model.eval(), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    env = one_step(math.nan, score_bound=10.0)
    driver = RolloutDriver(engine, tok, RewardRunner(lambda p, c, a: 0.0), SamplingConfig(max_new_tokens=4), model,
                           environment=env)
    plan = RolloutPlan(["1+2="], [3], [tok("1+2=", add_special_tokens=False)["input_ids"]], [3])
    result = driver.rollout(plan, step=0, seed_key=(0,))
    assert result.reward_failures == 3 and result.rollouts.malformed.all()
    assert torch.isfinite(result.rollouts.rewards).all()


def test_the_score_bound_is_the_runs(tokenizer):
    env = build_environment(OneStepEnv, {"options": {"value": 50.0}}, reward_options={"score_bound": 10.0})
    _, episodes = run(env, tokenizer, n=1)
    assert episodes[0].malformed and episodes[0].reward == -1.0


# -- class 5: an observation is bounded before it is tokenized, in the environments' time ------------------------
class FloodEnv(TextEnv):
    def step(self, action):
        flood = "12+3 " * 200_000  # 1 MB
        obs = flood if self.env_config.get("form") == "text" else [{"role": "tool", "content": flood}]
        return {"observations": obs, "reward": 0.0, "done": False, "metadata": {}}


@pytest.mark.parametrize("form", ["text", "messages"])
def test_a_huge_observation_is_cut_before_the_tokenizer_sees_it(form, tokenizer):
    seen = []

    class Spy:
        def __call__(self, text, **kwargs):
            seen.append(len(text) if isinstance(text, str) else 0)
            return tokenizer(text, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    env = Environment(make=lambda extras: FloodEnv({"form": form}, extras), max_tokens=64, name="flood")
    loop = MultiTurn(env, Spy())
    ids = tokenizer(["p"], add_special_tokens=False)["input_ids"]
    episodes = loop.run(fake_generate(tokenizer), ids, ["p"], [0], [2], SamplingParams())
    assert all(e.transcript.cut == "max_tokens" for e in episodes)  # as without the cut: it does not fit
    assert max(seen) <= 64 * loop.token_chars + 1  # not 1,000,000 characters
    assert loop.env_seconds > 0


def test_an_observation_that_fits_is_appended_whole(tokenizer):
    class Short(TextEnv):
        def step(self, action):
            self.turns += 1
            done = self.turns > 1
            return {"observations": "" if done else "1234", "reward": 1.0 * done, "done": done, "metadata": {}}

    env = Environment(make=lambda extras: Short({}, extras), max_tokens=64, name="short")
    _, episodes = run(env, tokenizer, n=1)
    assert ("observation", "1234") in episodes[0].transcript.turns and not episodes[0].malformed


# -- class 13: nonsense settings fail before any work, one line naming the key ---------------------------------
BAD = [
    ({"stop": [""]}, "env.stop=['']"),
    ({"stop": "</calc>"}, "env.stop='</calc>'"),
    ({"stop": [3]}, "env.stop=[3]"),
    ({"max_turns": 0}, "env.max_turns=0"),
    ({"max_turns": 2.5}, "env.max_turns=2.5"),
    ({"max_turns": True}, "env.max_turns=True"),
    ({"max_tokens": -1}, "env.max_tokens=-1"),
    ({"max_tokens": "many"}, "env.max_tokens='many'"),
    ({"timeout_s": 0}, "env.timeout_s=0"),
    ({"timeout_s": math.inf}, "env.timeout_s=inf"),
    ({"timeout_s": math.nan}, "env.timeout_s=nan"),
    ({"options": [1]}, "env.options=[1]"),
    ({"options": {"discount": 0}}, "env.options.discount=0"),
    ({"options": {"discount": "half"}}, "env.options.discount='half'"),
    ({"options": {"feedback": 3}}, "env.options.feedback=3"),
    ({"options": {"discout": 0.9}}, "env.options.discout is not an option of env=retry"),
]


@pytest.mark.parametrize("options, line", BAD)
def test_a_nonsense_env_setting_is_one_line_from_python(options, line):
    with pytest.raises(ConfigError) as err:
        build_environment("retry", options, reward="arithmetic")
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(line)


@pytest.mark.parametrize("options, line", [({"id": 3}, "env.options.id=3"),
                                           ({"id": "x", "env_config": [1]}, "env.options.env_config=[1]")])
def test_nonsense_skyrl_options_are_one_line(options, line):
    with pytest.raises(ConfigError) as err:
        environment_spec("skyrl", {"options": options})
    assert err.value.problems[0].startswith(line)


def test_the_module_rejects_it_before_the_model_loads(monkeypatch):
    from lit_rlvr import module

    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"env\.stop=\[''\] is not valid"):
        module.GRPOModule(env="retry", env_options={"stop": [""]})


def test_an_environment_class_with_an_empty_stop_string_is_refused():
    class Bad(OneStepEnv):
        stop = ("",)

    with pytest.raises(ConfigError, match="env.stop"):
        build_environment(Bad)


@pytest.mark.parametrize("override, line", [("env.stop=['']", "env.stop=['']"), ("env.max_turns=0", "env.max_turns=0"),
                                            ("env.timeout_s=-1", "env.timeout_s=-1"),
                                            ("env.options.discount=2", "env.options.discount=2")])
def test_train_py_checks_the_same_rows(override, line):
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.config_check import check_config

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["env=retry", override])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert [p for p in err.value.problems if p.startswith("env.")] == [p for p in err.value.problems]
    assert err.value.problems[0].startswith(line)


def test_the_lightning_cli_says_the_same_line_with_its_own_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lit_rlvr.app.cli", "fit", "--config", "conf/cli/tiny_grpo.yaml",
                          "--trainer.max_steps", "1", "--model.init_args.env.name", "retry",
                          "--model.init_args.env.stop", "['']", "--trainer.logger.init_args.save_dir",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("config error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert errors == ["config error: model.init_args.env.stop=[''] is not valid: expected a list of non-empty "
                      "strings (an empty one would end every model turn at its first token)"]


# -- class 14: a config check's error inside Hydra's instantiation is one line -----------------------------------
@pytest.mark.parametrize("skyrl_gym", ["as it is here", "installed (a stand-in)"])
def test_env_skyrl_without_its_id_is_one_line_from_train_py(skyrl_gym, tmp_path):
    """skyrl-gym installed or not: the missing id is named before anything is imported or built."""
    env = dict(os.environ)
    if skyrl_gym.startswith("installed"):
        (tmp_path / "skyrl_gym").mkdir()
        (tmp_path / "skyrl_gym" / "__init__.py").write_text("def make(env_id, env_config=None, extras=None):\n"
                                                            "    raise AssertionError('not to be called')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "train.py", "env=skyrl", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("config error:")]
    assert errors == ["config error: env=skyrl needs env.options.id, the skyrl-gym environment's registry id "
                      "(e.g. gsm8k_multi_turn)"], out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout


def test_a_value_left_missing_inside_hydra_instantiation_is_one_config_error():
    from lit_rlvr.app.recipe import _instantiate

    with pytest.raises(ConfigError, match=r"options\.id='\?\?\?'|options\.id=\?\?\?"):
        _instantiate({"_target_": "builtins.dict", "options": {"id": "???"}})


def test_a_check_raising_import_error_inside_hydra_instantiation_reaches_the_user_as_itself():
    from lit_rlvr.run.one_line import one_line
    from lit_rlvr.app.recipe import _instantiate

    with pytest.raises(ValueError, match="env='nope' is not valid") as err:
        _instantiate({"_target_": "lit_rlvr.envs.build_environment", "name": "nope"})
    assert one_line(err.value) is None or one_line(err.value)[0] == "config error"
    with pytest.raises(ImportError, match="no_such_package"):  # an optional package a constructor checks for
        _instantiate({"_target_": "test_hostile_envs.needs_a_package"})


def needs_a_package():
    raise ImportError("no_such_package is not installed: pip install no_such_package")


# -- class 6: a built-in environment's defaults are its own, from every entry point ------------------------------
@pytest.mark.parametrize("name", ["retry", "calculator"])
def test_a_built_in_environment_by_name_alone_runs(name, tokenizer):
    env = build_environment(name, None, reward="arithmetic")  # what the Lightning CLI passes: no options
    spec = environment_spec(name)
    assert spec.options["reward"] is None and spec.limits["timeout_s"] == 10.0
    _, episodes = run(env, tokenizer, answers=[7], n=2)
    assert all(e.transcript.error is None for e in episodes), [e.transcript.error for e in episodes]
    assert all(e.reward == 1.0 for e in episodes)  # "7" is the right answer


def test_hydra_and_python_build_the_same_environment():
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.config_check import env_arguments

    for name in ("retry", "calculator"):
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            args = env_arguments(compose("config", overrides=[f"env={name}"]))
        assert environment_spec(args["env"], args["env_options"]) == environment_spec(name)


def test_every_rollout_failing_is_said_once_naming_the_error(tokenizer, caplog):
    class Broken(TextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__(env_config, extras)
            self.reward_fn = self.env_config["reward"]

        def step(self, action):
            raise AssertionError("unreachable")

    env = Environment(make=lambda extras: Broken({}, extras), name="broken")
    with caplog.at_level(logging.WARNING):
        loop, episodes = run(env, tokenizer, n=3)
        ids = tokenizer(["p0"], add_special_tokens=False)["input_ids"]
        loop.run(fake_generate(tokenizer), ids, ["p0"], [0], [3], SamplingParams())
    said = [r.getMessage() for r in caplog.records if "every one of" in r.getMessage()]
    assert len(said) == 1 and "KeyError" in said[0] and "'reward'" in said[0]


def test_an_environment_module_that_raises_on_import_is_one_config_error(tmp_path, monkeypatch):
    """Not only a missing module: one whose own code raises while it is imported is named in one line."""
    (tmp_path / "boom_env.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^env='boom_env:X': importing boom_env raised RuntimeError: boom at import"):
        environment_spec("boom_env:X", {})


class SlowCloseEnv(OneStepEnv):
    """A close() that takes far longer than env.timeout_s (or raises, with `value="raise"`)."""

    def close(self):
        if self.env_config["value"] == "raise":
            raise OSError("socket already closed")
        time.sleep(30)


@pytest.mark.parametrize("how", ["hangs", "raises"])
def test_a_slow_or_failing_close_is_counted_and_a_hung_one_is_waited_for_once(how, tokenizer, caplog):
    """Issue 61 (minor): a close() that hangs cost env.timeout_s at every step, and nothing counted it."""
    value = "raise" if how == "raises" else 1.0
    env = Environment(make=lambda extras: SlowCloseEnv({"value": value}, extras), name="slow-close", timeout_s=0.5)
    loop = MultiTurn(env, tokenizer)
    ids = tokenizer(["p0"], add_special_tokens=False)["input_ids"]
    took = []
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # three steps
            t0 = time.monotonic()
            episodes = loop.run(fake_generate(tokenizer), ids, ["p0"], [0], [2], SamplingParams())
            took.append(time.monotonic() - t0)
            failures = sum(e.transcript.close_error is not None for e in episodes)  # env/close_failures
            assert failures == (2 if how == "raises" or len(took) == 1 else 0)
    assert all(e.transcript.error is None for e in episodes)  # the rollouts themselves are kept
    said = [r.getMessage() for r in caplog.records if "close()" in r.getMessage()]
    assert len(said) == 1 and "env/close_failures" in said[0]
    if how == "hangs":
        assert took[0] >= 0.5 and max(took[1:]) < 0.5  # waited for once, not at every step
