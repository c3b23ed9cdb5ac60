"""The built-in environments (calculator, retry), the `env=` config and the skyrl-gym adapter."""

from __future__ import annotations

import pytest

from lit_rlvr.data.tasks.arithmetic_cot import arithmetic_cot_reward
from lit_rlvr.envs import build_environment
from lit_rlvr.envs.calculator import CalculatorEnv, demonstration, evaluate
from lit_rlvr.envs.retry import RetryEnv
from lit_rlvr.models.tiny import build_tokenizer
from lit_rlvr.rollout.warmup import sft_batch


def extras(answer, prompt="47*86=", max_turns=4):
    return {"reward_spec": {"ground_truth": answer}, "prompt": prompt, "max_turns": max_turns}


def test_calculator_evaluates_integer_expressions_only():
    assert evaluate("47*86") == 4042 and evaluate(" (3+4)*-2 ") == -14 and evaluate("7//2") == 3
    for bad in ("2**10", "__import__('os')", "1/2", "7//0", "9" * 20, "x", "1+", "1e3"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_calculator_runs_the_call_then_scores_the_whole_response():
    env = CalculatorEnv({"reward": arithmetic_cot_reward}, extras(4042))
    out = env.step("<calc>47*86</calc>")
    assert out == {"observations": "4042", "reward": 0.0, "done": False, "metadata": {"tool_call": True}}
    env = CalculatorEnv({"reward": arithmetic_cot_reward}, extras(4042))
    env.step("<calc>47*86</calc>")
    final = env.step("\nAnswer: 4042")
    assert final["done"] and final["reward"] == 1.0 and not final["metadata"]["malformed"]
    assert env.response == "<calc>47*86</calc>4042\nAnswer: 4042"
    bad = CalculatorEnv({"reward": arithmetic_cot_reward}, extras(4042))
    assert bad.step("<calc>47**86</calc>")["observations"] == "?"
    assert CalculatorEnv.stop == ("</calc>",)


def test_retry_discounts_later_right_answers_and_stops_at_the_turn_limit():
    env = RetryEnv({"reward": arithmetic_cot_reward, "discount": 0.5}, extras(7, max_turns=3))
    wrong = env.step("Answer: 6")
    assert not wrong["done"] and wrong["observations"] == "\nWrong, try again.\n" and wrong["reward"] == 0
    assert not wrong["metadata"]["tool_call"]
    right = env.step("Answer: 7")
    assert right["done"] and right["reward"] == 0.5
    env = RetryEnv({"reward": arithmetic_cot_reward}, extras(7, max_turns=2))
    env.step("Answer: 1")
    last = env.step("Answer: 2")
    assert last["done"] and last["reward"] == -1.0
    with pytest.raises(ValueError, match="discount"):
        RetryEnv({"reward": arithmetic_cot_reward, "discount": 0.0}, extras(7))


def test_build_environment_reads_the_config_group():
    assert build_environment("none") is None and build_environment(None) is None
    env = build_environment("calculator", {"options": {"reward": None}, "max_turns": 3, "max_tokens": 99,
                                           "timeout_s": 2, "stop": ["\n\n"]}, reward="arithmetic_cot",
                            reward_options={"timeout_s": 5})
    assert (env.max_turns, env.max_tokens, env.timeout_s, env.stop) == (3, 99, 2.0, ("</calc>", "\n\n"))
    made = env.make(extras(4042))
    assert isinstance(made, CalculatorEnv) and made.reward_fn is arithmetic_cot_reward and made.answer == 4042
    with pytest.raises(ValueError, match="env.max_turn"):
        build_environment("calculator", {"max_turn": 3})
    with pytest.raises(ValueError, match="env.max_turns=0"):
        build_environment("retry", {"options": {"reward": "arithmetic_cot"}, "max_turns": 0})
    with pytest.raises(ValueError, match="env='nope' is not valid"):
        build_environment("nope")
    with pytest.raises(ValueError, match="env.options.id"):
        build_environment("skyrl", {"options": {}})


def test_env_configs_compose_and_none_is_the_default():
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.recipe import env_arguments
    from tiny_options import REPO

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        assert env_arguments(compose("config")) == {}
        cfg = compose("config", overrides=["data=arithmetic_cot", "env=calculator"])
        assert cfg.model.options.tool_frac == 0.25 and cfg.model.options.task == "arithmetic_cot"
        args = env_arguments(cfg)
        assert args["env"] == "calculator"
        env = build_environment(args["env"], args["env_options"], reward=cfg.reward.name)
        assert env.max_tokens == 160  # the class's default (CalculatorEnv.defaults)
        retry = env_arguments(compose("config", overrides=["data=arithmetic_cot", "env=retry",
                                                           "env.options.discount=0.25"]))
        env = build_environment(retry["env"], retry["env_options"], reward=cfg.reward.name)
        assert retry["env"] == "retry" and env.make(extras(7)).discount == 0.25 and env.max_turns == 3


def test_warm_up_demonstrations_train_on_the_model_segments_only():
    tokenizer = build_tokenizer()
    segments = demonstration("47*86")
    assert segments == [("<calc>47*86</calc>", True), ("4042", False), ("\nAnswer: 4042", True)]
    ids, mask, labels = sft_batch(tokenizer, [{"prompt": "47*86=", "answer": 4042, "segments": segments}])
    text_of = lambda row: tokenizer.decode([int(t) for t in row if t >= 0], skip_special_tokens=True)  # noqa: E731
    assert text_of(labels[0]) == "<calc>47*86</calc>\nAnswer: 4042"  # the result is in the input, not a label
    seen = tokenizer.decode(ids[0][mask[0].bool()], skip_special_tokens=True)
    assert seen == "47*86=<calc>47*86</calc>4042\nAnswer: 4042"
    plain, _, plain_labels = sft_batch(tokenizer, [{"prompt": "1+2=", "answer": 3, "target": "Answer: 3"}])
    assert tokenizer.decode(plain[0], skip_special_tokens=True) == "1+2=Answer: 3"
    assert text_of(plain_labels[0]) == "Answer: 3"


def test_tool_warm_up_needs_the_chain_of_thought_task(tmp_path):
    from lit_rlvr.rollout.warmup import warm_start_tiny

    with pytest.raises(ValueError, match="model.options.tool_frac"):
        warm_start_tiny(tmp_path, tool_frac=0.25, task="arithmetic")


# -- skyrl-gym: its environments run here, ours run there ---------------------------------------------------------
def test_a_skyrl_gym_environment_runs_unchanged():
    pytest.importorskip("skyrl_gym")
    from lit_rlvr.models.tiny import build_tiny
    from lit_rlvr.rewards.base import RewardRunner
    from lit_rlvr.rollout.batch import RolloutPlan
    from lit_rlvr.rollout.driver import RolloutDriver
    from lit_rlvr.rollout.engine import SamplingConfig
    from lit_rlvr.rollout.hf import HFEngine

    env = build_environment("skyrl", {"options": {"id": "gsm8k_multi_turn"}, "max_turns": 3, "max_tokens": 400})
    model, tokenizer = build_tiny(0)
    engine = HFEngine(model.eval(), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    driver = RolloutDriver(engine, tokenizer, RewardRunner(lambda p, c, a: 0.0), SamplingConfig(max_new_tokens=8),
                           model, environment=env)
    plan = RolloutPlan(["What is 1+2?"], ["3"], [tokenizer("What is 1+2?")["input_ids"]], [2])
    r = driver.rollout(plan, step=0, seed_key=(0,)).rollouts
    for t in r.transcripts:
        assert t.error is None and t.cut is None  # the environment itself ends at its max_turns
        assert [role for role, _ in t.turns] == ["assistant", "observation", "assistant", "observation", "assistant"]
        assert "#### ANSWER" in t.turns[1][1]  # its user message, rendered as text for a model without a template


def test_our_environments_run_under_skyrl_gym():
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from lit_rlvr.envs import skyrl_class

    skyrl_gym.register(id="lit_rlvr_calculator", entry_point=skyrl_class(CalculatorEnv))
    env = skyrl_gym.make("lit_rlvr_calculator", env_config={"reward": arithmetic_cot_reward}, extras=extras(4042))
    prompt, _ = env.init([{"role": "user", "content": "47*86="}])
    assert env.step("<calc>47*86</calc>")["observations"] == "4042"
    assert env.step("\nAnswer: 4042")["reward"] == 1.0


def test_resume_refuses_another_environment_and_accepts_checkpoints_from_before_env():
    from lit_rlvr.run.resume import config_differences

    before_env = {"seed": 0, "algorithm": {"lr": 1.0}}  # a checkpoint written before the env group existed
    assert config_differences(before_env, {**before_env, "env": {"name": "none"}}) == []
    calculator = {**before_env, "env": {"name": "calculator", "max_turns": 4, "timeout_s": 10}}
    assert [k for k, _, _ in config_differences(calculator, {**before_env, "env": {"name": "none"}})] == [
        "env.max_turns", "env.name"]
    slower = {**calculator, "env": {**calculator["env"], "timeout_s": 60}}
    assert config_differences(calculator, slower) == []  # a time bound does not change what the run computes
