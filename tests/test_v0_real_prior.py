"""V0 as a real prior: on the arithmetic task, KernelHead over MiniLM features, fit on 256 context records of the
tiny policy, predicts held-out prompts' outcomes with AUC ≥ 0.65 (measured: ≈ 0.85 per sample, seed 0)."""

import os

import pytest
import torch

from lit_rlvr.data.tasks.arithmetic import ArithmeticTask, arithmetic_reward
from lit_rlvr.functional.ranking import binary_auroc
from lit_rlvr.models import load_policy
from lit_rlvr.rollout.warmup import resolve_model_path
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.value import ContextBuffer, ValueModel
from tiny_options import TINY as TINY_OPTIONS

TINY = TINY_OPTIONS  # conf/model/tiny.yaml: reuses its cache
CONTEXT, HELD_OUT, N = 256, 64, 8


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Prompts of the arithmetic task and the tiny policy's outcomes on them: [P] prompts, [P, N] bool."""
    cache_dir = os.environ.get("LIT_RLVR_CACHE") or str(tmp_path_factory.mktemp("cache"))
    model, tokenizer = load_policy(resolve_model_path("tiny", {"cache_dir": cache_dir, **TINY}))
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    problems = ArithmeticTask(levels=(1, 2, 3, 4, 5), seed=0).problems(CONTEXT + HELD_OUT, "train")
    ids = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    completions = engine.generate(ids, [N] * len(ids), SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    correct = [[arithmetic_reward(p["prompt"], tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                  p["answer"]).score > 0
                for c in per] for p, per in zip(problems, completions)]
    return [p["prompt"] for p in problems], torch.tensor(correct)  # [P], [P, N]


def test_kernel_head_on_minilm_predicts_the_tiny_policy(outcomes):
    prompts, correct = outcomes
    rate = correct.float().mean(-1)  # [P]
    assert 0.05 < float(rate.mean()) < 0.95  # the task is neither solved nor hopeless for this policy
    context = ContextBuffer(capacity=CONTEXT, min_context=32)
    context.add(prompts[:CONTEXT], rate[:CONTEXT], torch.full((CONTEXT,), N))
    model = ValueModel.create(backbone="minilm", head="kernel")
    p_hat, metrics = model.predict(prompts[CONTEXT:], context)  # [HELD_OUT]
    assert p_hat.shape == (HELD_OUT,) and metrics["context_size"] == CONTEXT
    # the claim: per-sample outcomes of held-out prompts (HELD_OUT × N labels, fresh rollouts not in the context)
    per_sample = binary_auroc(p_hat.repeat_interleave(N), correct[CONTEXT:].flatten())
    print(f"real-prior AUC: per-sample {float(per_sample):.3f}, "
          f"success rate >= 0.5 {float(binary_auroc(p_hat, rate[CONTEXT:] >= 0.5)):.3f}")
    assert per_sample >= 0.65
    # the same context with its labels shuffled carries no signal: the AUC is the features', not the head's
    shuffled = ContextBuffer(capacity=CONTEXT, min_context=32)
    shuffled.add(prompts[:CONTEXT], rate[:CONTEXT][torch.randperm(CONTEXT, generator=torch.Generator().manual_seed(0))],
                 torch.full((CONTEXT,), N))
    p_null, _ = model.predict(prompts[CONTEXT:], shuffled)
    assert binary_auroc(p_null.repeat_interleave(N), correct[CONTEXT:].flatten()) < per_sample - 0.1
