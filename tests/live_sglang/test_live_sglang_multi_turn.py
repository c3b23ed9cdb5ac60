"""Multi-turn rollouts on the real `sglang.Engine` (CPU, fp32) against `HFEngine`: greedy transcripts token for
token, sampled ones consistent with the policy's forward (tests/multi_turn_live.py)."""

import sys
from pathlib import Path

import pytest

from sglang_live import cpu_options, live

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared checks
from multi_turn_live import assert_greedy_transcripts_equal_hf, assert_sampled_rollouts_are_consistent  # noqa: E402

pytestmark = live


@pytest.fixture(scope="module")
def policy(tiny_path):
    from lit_rlvr.models import load_policy

    model, tokenizer = load_policy(tiny_path, "float32")
    return model.eval(), tokenizer


def test_multi_turn_rollouts_equal_hf(policy):
    from lit_rlvr.rollout.sglang import SGLangEngine
    from lit_rlvr.rollout.weights import push_weights

    model, tokenizer = policy
    engine = SGLangEngine(model, tokenizer, **cpu_options())
    try:
        push_weights(engine, model, bucket_bytes=1 << 20)
        assert_greedy_transcripts_equal_hf(engine, model, tokenizer)
        assert_sampled_rollouts_are_consistent(engine, model, tokenizer)
    finally:
        engine.shutdown()
