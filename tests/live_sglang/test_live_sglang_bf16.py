"""An fp32 trainer pushing into a bf16 `sglang.Engine` on a CPU (one engine for the module), and an engine
whose scheduler cannot start: an `EngineError`, in bounded time, with this process alive."""

import contextlib
import copy
import gc
import signal

import pytest
import torch

from lit_rlvr.rollout.engine import EngineError, SamplingParams
from lit_rlvr.rollout.weights import push_weights
from sglang_live import cpu_options, live, own_children

pytestmark = live
PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4="]
START_BOUND_S = 600  # a start-up that neither succeeds nor fails by then is a hang


@pytest.fixture(scope="module")
def policy(tiny_path):
    from lit_rlvr.models import load_policy

    model, tokenizer = load_policy(tiny_path, "float32")
    return model.eval(), tokenizer


def _teacher_forced(model, prompt, token_ids):
    ids = torch.tensor([prompt + token_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, token_ids[:, None]).squeeze(1)


def test_fp32_trainer_into_bf16_engine(policy):
    from lit_rlvr.rollout.hf import HFEngine
    from lit_rlvr.rollout.sglang import SGLangEngine

    model, tokenizer = policy
    engine = SGLangEngine(model, tokenizer, **cpu_options(dtype="bfloat16"))
    try:
        assert engine.weight_dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
        push_weights(engine, model, bucket_bytes=32 << 10, dtype=engine.weight_dtype)  # as GRPOModule pushes
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        got = engine.generate(prompts, [1] * len(prompts), params)
    finally:
        engine.shutdown()
    bf16 = HFEngine(copy.deepcopy(model).to(torch.bfloat16), pad_id=tokenizer.pad_token_id,
                    eos_id=tokenizer.eos_token_id)
    want = bf16.generate(prompts, [1] * len(prompts), params)
    for prompt, (g,), (w,) in zip(prompts, got, want):
        # the same bf16 weights: the first greedy token agrees; later ones may part where bf16 kernels round apart
        assert int(g.token_ids[0]) == int(w.token_ids[0])
        # the engine's log-probs are the fp32 model's, up to bf16 rounding (dummy weights would be far off)
        assert (g.logprobs - _teacher_forced(model, prompt, g.token_ids)).abs().max() < 0.1


def test_a_scheduler_that_cannot_start_is_an_engine_error(policy, train_runs):
    """load_format=auto on the config-only directory the engine starts from: no weight files, so sglang's
    scheduler raises while it loads the model and signals this process, whose default answer (sglang's) is to
    kill it. (A too small mem_fraction_static is no such option on a shared machine: sglang checks it against
    free memory, which other processes move.) Before the clean-up of a failed start, its killed children stayed
    zombies and its zmq contexts hung this process when garbage-collected."""
    from lit_rlvr.rollout.sglang import SGLangEngine

    model, tokenizer = policy
    contexts_before = {id(c) for c in _zmq_contexts()}
    children_before = {p.pid for p in own_children(train_runs)}  # e.g. multiprocessing's tracker

    def hung(signum, frame):
        raise TimeoutError(f"SGLangEngine neither started nor failed in {START_BOUND_S} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(START_BOUND_S)
    # the clean-up of a failed start kills the children this process started meanwhile: no background run starts
    try:
        with train_runs.starting if train_runs else contextlib.nullcontext(), \
                pytest.raises(EngineError, match="died while the engine was starting|did not start"):
            engine = SGLangEngine(model, tokenizer, **cpu_options(server_args={"load_format": "auto"}))
            engine.shutdown()  # only reached when the test fails
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    # its processes were killed and reaped with it (a killed child stays a zombie until reaped)
    assert [p.pid for p in own_children(train_runs) if p.pid not in children_before] == []
    # a context left open would block this process when collected, waiting for its dead peers
    assert [c for c in _zmq_contexts() if id(c) not in contexts_before and not c.closed] == []


def _zmq_contexts() -> list:
    import zmq

    return [obj for obj in gc.get_objects() if isinstance(obj, zmq.Context)]
