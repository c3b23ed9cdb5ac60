"""Issue 42, class "a run that cannot end": every bound of a rollout is checked against the model's positions before
any work (lit_rlvr/config/bounds.py), the multi-turn loop stops a rollout at the model's last position, and a stop
request is honoured within `stop_grace_s` even in a step that does not end (lit_rlvr/run/stop.py). Before the fix
`env=retry env.name=mymod:NeverEnds env.max_turns=10000 env.max_tokens=100000` ran 15 minutes and 4 GB without
ending step 0, and SIGTERM waited for the end of that step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lit_rlvr.config.bounds import TINY_CONTEXT
from lit_rlvr.app.config_check import check_config
from lit_rlvr.config.errors import ConfigError, StopRequested
from lit_rlvr.envs import Environment, TextEnv
from lit_rlvr.models.tiny import build_tiny, save
from lit_rlvr.module import GRPOModule
from lit_rlvr.rewards.base import RewardRunner
from lit_rlvr.rollout.batch import RolloutPlan
from lit_rlvr.rollout.driver import RolloutDriver
from lit_rlvr.rollout.engine import Completion, SamplingConfig, SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.multi_turn import MultiTurn, call_all
from lit_rlvr.run.resume import load_checkpoint
from lit_rlvr.run.stop import STOP, stop_requests

REPO = Path(__file__).resolve().parents[1]
NEVER_ENDS = "tests.fault_helpers:StallingEnv"


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("overrides, line", [
    (["env=retry", f"env.name={NEVER_ENDS}", "env.max_turns=10000", "env.max_tokens=100000"],
     f"env.max_tokens=100000 is not valid: expected an integer < {TINY_CONTEXT} (the model has {TINY_CONTEXT} "
     "positions, and a prompt needs at least one)"),
    (["algorithm.max_new_tokens=100000"], "algorithm.max_new_tokens=100000 is not valid: expected an integer < 256"),
    (["data=jsonl", "data.path=x.jsonl", "data.max_prompt_tokens=250", "algorithm.max_new_tokens=8"],
     "data.max_prompt_tokens=250 is not valid: expected an integer <= 248 (the model's 256 positions minus "
     "algorithm.max_new_tokens=8), or null"),
    (["env=calculator", "+data.max_prompt_tokens=100"],
     "data.max_prompt_tokens=100 is not valid: expected an integer <= 96 (the model's 256 positions minus "
     "env.max_tokens=160), or null"),
])
def test_train_py_refuses_a_rollout_bound_past_the_tiny_models_positions_before_any_work(overrides, line):
    """What train.py runs before the warm-up: one line naming the key, the value and the limit."""
    with pytest.raises(ConfigError) as caught:
        check_config(_compose(*overrides))
    assert caught.value.problems[0].startswith(line), caught.value.problems


def test_shipped_environments_fit_the_tiny_model():
    for env in ("calculator", "retry"):
        check_config(_compose(f"env={env}"))


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """An untrained tiny model saved with 64 positions: a local directory declares its context in config.json."""
    model, tokenizer = build_tiny(0)
    model.config.max_position_embeddings = 64
    return save(model, tokenizer, tmp_path_factory.mktemp("short") / "model")


def test_a_local_models_positions_are_checked_before_it_loads_and_by_the_constructor(short_model):
    with pytest.raises(ConfigError, match=r"^algorithm.max_new_tokens=64 is not valid: expected an integer < 64"):
        check_config(_compose(f"model.name_or_path={short_model}", "algorithm.max_new_tokens=64"))
    # the Lightning CLI and Python reach only the constructor: the same line, once the model has loaded
    with pytest.raises(ConfigError, match=r"^env.max_tokens=100000 is not valid: expected an integer < 64"):
        GRPOModule(model=str(short_model), env=NEVER_ENDS, env_options={"max_turns": 10000, "max_tokens": 100000})
    with pytest.raises(ConfigError, match=r"^algorithm.max_new_tokens=64 is not valid"):
        GRPOModule(model=str(short_model), max_new_tokens=64)


class Endless(TextEnv):
    """Never done; an observation after every turn. Raises after 64 steps (more turns than 64 positions can
    hold), so a loop that ignores the context fails the test instead of running on."""

    def step(self, action: str):
        self.turns += 1
        if self.turns > 64:
            raise RuntimeError("the loop ran past the model's context")
        return {"observations": self.env_config.get("obs", "ab"), "reward": 0.0, "done": False,
                "metadata": {"tool_call": True}}


def _endless(max_tokens: int = 100_000, **config) -> Environment:
    # built directly: the dataclass checks only >= 1, as a careless Python caller might
    return Environment(make=lambda extras: Endless(config, extras), max_turns=100_000, max_tokens=max_tokens,
                       timeout_s=10.0, name="endless")


def test_a_never_done_rollout_ends_at_the_models_last_position():
    model, tokenizer = build_tiny(0)
    model.config.max_position_embeddings = 64  # what the driver reads; short, so the test is quick
    engine = HFEngine(model.eval(), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    driver = RolloutDriver(engine, tokenizer, RewardRunner(lambda p, c, a: 0.0), SamplingConfig(max_new_tokens=8),
                           model, environment=_endless())
    prompts = ["1+2=", "30+40="]
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    started = time.monotonic()
    result = driver.rollout(RolloutPlan(prompts, [3, 70], ids, [2, 2]), step=0, seed_key=(0, 0))
    assert time.monotonic() - started < 120
    rollouts = result.rollouts
    assert [t.error for t in rollouts.transcripts] == [None] * 4
    assert [t.cut for t in rollouts.transcripts] == ["context"] * 4
    assert rollouts.finish_reason == ["length"] * 4 and bool(rollouts.malformed.all())
    lengths = rollouts.prompt_mask.sum(-1) + rollouts.response_attention_mask.sum(-1)  # [N]
    assert int(lengths.max()) <= 64


class _Tokenizer:
    """A character tokenizer that records the length of every text it tokenizes."""

    def __init__(self):
        self.lengths: list[int] = []

    def __call__(self, text, add_special_tokens=False):
        self.lengths.append(len(text))
        return {"input_ids": [ord(c) % 50 + 3 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _one_token(prompts, counts, params: SamplingParams):
    return [[Completion(torch.tensor([5]), torch.tensor([-0.5]), "stop") for _ in range(n)] for n in counts]


def test_a_10mb_observation_cuts_its_rollout_without_being_tokenized_whole():
    tokenizer = _Tokenizer()
    episodes = MultiTurn(_endless(max_tokens=200, obs="x" * 10_000_000), tokenizer, context=256).run(
        _one_token, [[1, 2, 3]], ["p"], [0], [2], SamplingParams(max_new_tokens=8))
    assert [e.transcript.cut for e in episodes] == ["max_tokens", "max_tokens"]
    assert [len(e.ids) for e in episodes] == [1, 1]  # the model's turn, no observation
    assert max(tokenizer.lengths) < 100_000


def test_a_stop_request_past_its_grace_abandons_the_turn_loop_and_a_decode():
    model, tokenizer = build_tiny(0)
    engine = HFEngine(model.eval(), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    loop = MultiTurn(_endless(max_tokens=200), tokenizer, context=256)
    try:
        STOP.arm(0.0)
        STOP.request("SIGTERM")
        with pytest.raises(StopRequested, match="SIGTERM .* stop_grace_s=0"):
            loop.run(engine.generate, [[5, 6]], ["p"], [0], [2], SamplingParams(max_new_tokens=8))
        with pytest.raises(StopRequested):
            engine.generate([[5, 6]], [2], SamplingParams(max_new_tokens=8))
        STOP.arm(None)  # outside a run (or with several ranks): requests wait for the step's end
        STOP.request("SIGTERM")
        assert len(engine.generate([[5, 6]], [2], SamplingParams(max_new_tokens=8))[0]) == 2
    finally:
        STOP.arm(None)


def test_sigterm_in_a_step_that_cannot_end_exits_in_bounded_time_naming_the_intact_checkpoint(tmp_path):
    """Step 1 ends and is saved; step 2's rollouts are never done (each environment step takes 2 s, within its
    timeout, and the tokens fit the context: ~25 turns, a minute). SIGTERM in step 2: the run exits 0 within the
    grace period plus a turn, saves nothing of step 2 and names last.ckpt, which holds step 1 and loads."""
    run_dir, marker = tmp_path / "run", tmp_path / "stalled"
    log = tmp_path / "run.log"
    overrides = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=2",
                 "algorithm.group_size=2", "checkpoint_every=1", "trainer.max_steps=5", "stop_grace_s=1",
                 "env=retry", f"env.name={NEVER_ENDS}", "env.max_turns=200", "env.max_tokens=200",
                 "env.timeout_s=30", f"+env.options.marker={marker}", "+env.options.step_s=2",
                 f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "train.py", *overrides], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 600  # the first run of a session may build the tiny model's warm-up
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), log.read_text()[-3000:]
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0 and took < 60, text[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"{last} holds step 1" in text and f"resume={last}" in text, text[-3000:]
    assert load_checkpoint(last)["global_step"] == 1  # what resume= loads first
    assert not list(last.parent.glob("*.tmp*"))


def test_a_stop_request_does_not_wait_for_an_environment_call_with_a_long_timeout():
    """An environment call that sleeps far past the stop's grace (its own timeout is longer still): the wait for it
    is abandoned once the request is older than the grace, not when the call's timeout ends (a run that hung)."""
    STOP.arm(0.5)
    try:
        STOP.request("SIGTERM")
        started = time.monotonic()
        with pytest.raises(StopRequested):
            call_all([lambda: time.sleep(30)], timeout_s=1e5)
        assert time.monotonic() - started < 10
    finally:
        STOP.arm(None)


def test_sigterm_during_the_evaluation_after_training_is_honoured_after_its_grace():
    """The evaluation after training runs outside the fit's handlers: a SIGTERM there must not wait for it (an
    evaluation of never-done environments ran minutes past the signal)."""
    before = signal.getsignal(signal.SIGTERM)
    with stop_requests(0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(StopRequested, match="SIGTERM"):
            call_all([lambda: time.sleep(30)], timeout_s=1e5)
    assert signal.getsignal(signal.SIGTERM) is before and STOP.grace_s is None


def test_a_completion_ends_at_the_models_last_position():
    """`max_new_tokens=255` passes the check (< 256 positions) but a prompt of 10 tokens leaves room for 246: the
    engine ends every row there ("length") instead of decoding past the model's positions."""
    model, tokenizer = build_tiny(0)
    engine = HFEngine(model.eval(), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    prompt = list(range(3, 13))  # 10 tokens
    params = SamplingParams(max_new_tokens=TINY_CONTEXT - 1, ignore_eos=True, seed=0)
    (completion,), = engine.generate([prompt], [1], params)
    assert len(completion.token_ids) == TINY_CONTEXT - len(prompt) and completion.finish_reason == "length"
