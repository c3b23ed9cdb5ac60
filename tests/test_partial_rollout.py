"""Pushes that land while the HF engine generates (`push_in_flight`, rollout.partial_rollout): the tokens before the
swap are the old weights' and tagged with their version, those after it the new weights', with the KV cache kept or
computed again; nothing lands untagged, and the oldest version of each completion is the one the bound reads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.models import load_policy
from lit_rlvr.rollout.batch import RolloutPlan, rollouts_from_completions
from lit_rlvr.rollout.engine import RolloutEngine, SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.pipeline import completion_versions
from lit_rlvr.rollout.segments import SegmentedPushes, generate_in_segments

PROMPTS = ["12+34=", "5+5=", "71-18="]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, ignore_eos=True)  # every row 8 tokens long
SWAP_AT = 2  # the push is staged during the first decode forward: it lands before the forward that draws token 2


@pytest.fixture(scope="module")
def models(tiny_path):
    model, tokenizer = load_policy(tiny_path)
    other = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():  # weights far from the first ones: every logit changes
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval(), other.eval(), tokenizer


def _plan(tokenizer) -> RolloutPlan:
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return RolloutPlan(PROMPTS, [46, 10, 53], ids, [2] * len(PROMPTS))


def _generate(model, tokenizer, push=None, recompute_kv=False):
    """A copy engine tagged 0; with `push` (weights), a push tagged 1 made from another thread during the first
    decode forward of the generation. Returns its rollouts."""
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    with engine.push_in_flight(0):  # no generation under way: lands at once, as a tag only
        pass
    forward, calls = engine._forward, []

    def forward_then_push(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if push is not None and len(calls) == 2:  # the first decode forward (the prefill is the first call)
            def trainer():
                with engine.push_in_flight(1, recompute_kv=recompute_kv):
                    engine.load_weights((n, p.detach()) for n, p in push.named_parameters())
            thread = threading.Thread(target=trainer)
            thread.start()
            thread.join()
        return out

    engine._forward = forward_then_push
    plan = _plan(tokenizer)
    completions = engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS)
    return rollouts_from_completions(plan, completions, source=0, pad_id=tokenizer.pad_token_id), engine


def _scored(model, rollouts) -> torch.Tensor:
    """The log-probs `model` gives the rollouts' tokens, the whole sequence in one forward. [N, T]"""
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask], 1)
    with torch.no_grad():
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = rollouts.response_ids.shape[1]
    return F.token_logprobs(logits[:, -width - 1 : -1], rollouts.response_ids, temperature=1.0)


def test_without_a_push_in_flight_every_token_has_the_engines_tag(models):
    model, _, tokenizer = models
    rollouts, _ = _generate(model, tokenizer)
    assert rollouts.token_version is not None and (rollouts.token_version == 0).all()
    untagged = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    plan = _plan(tokenizer)
    assert all(c.versions is None for group in untagged.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS)
               for c in group)


@pytest.mark.parametrize("recompute_kv", [False, True], ids=["keep", "recompute"])
def test_a_push_lands_between_two_decode_steps_and_each_token_keeps_its_version(models, recompute_kv):
    model, other, tokenizer = models
    before, _ = _generate(model, tokenizer)
    swapped, engine = _generate(model, tokenizer, push=other, recompute_kv=recompute_kv)
    versions = swapped.token_version
    assert (versions[:, :SWAP_AT] == 0).all() and (versions[:, SWAP_AT:] == 1).all()
    # the segment before the swap is the old weights' own: the same tokens and log-probs as without a push
    assert torch.equal(swapped.response_ids[:, :SWAP_AT], before.response_ids[:, :SWAP_AT])
    assert torch.equal(swapped.old_logp[:, :SWAP_AT], before.old_logp[:, :SWAP_AT])
    oldest, spans = completion_versions(versions, swapped.response_mask, fallback=0)
    assert oldest.tolist() == [0] * swapped.num_samples and spans.all()
    new = _scored(other, swapped)[:, SWAP_AT:]
    if recompute_kv:  # the whole prefix again under the new weights: their log-probs, to rounding
        assert torch.allclose(swapped.old_logp[:, SWAP_AT:], new, atol=1e-4)
    else:  # the prefix's keys and values stay the old weights': the first token after the swap is drawn from neither
        assert not torch.allclose(swapped.old_logp[:, SWAP_AT], new[:, 0], atol=1e-3)
    # the engine holds the new weights after the generation
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), other.parameters()))


def test_a_push_that_fails_lands_nothing(models):
    model, other, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    engine._generating = True  # as if a generation were under way: the loads are staged
    with pytest.raises(KeyError):
        with engine.push_in_flight(3):
            engine.load_weights((n, p.detach()) for n, p in other.named_parameters())
            raise KeyError("the push failed")
    assert engine._staged is None and engine._staging is None


def test_completion_versions_reads_the_oldest_sampled_token():
    versions = torch.tensor([[3, 3, 4, 0], [5, 5, 5, 5], [2, 9, 9, 9]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True], [False, False, False, False]])
    oldest, spans = completion_versions(versions, mask, fallback=7)
    assert oldest.tolist() == [3, 5, 7] and spans.tolist() == [True, False, False]


def test_a_shared_engine_takes_no_push_in_flight(models):
    model, _, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="shared")
    assert not engine.swaps_in_flight
    with pytest.raises(RuntimeError, match="copy mode only"):
        with engine.push_in_flight(0):
            pass


def test_the_pushing_threads_own_post_push_check_generates_inside_a_direct_push(models):
    """The post-push check samples with the engine inside the push: the push's own thread must not wait for it."""
    model, other, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    plan, out = _plan(tokenizer), []

    def push_then_check():
        with engine.push_in_flight(1):
            engine.load_weights((n, p.detach()) for n, p in other.named_parameters())
            out.append(engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS))

    thread = threading.Thread(target=push_then_check, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and out, "the check's generation waited for its own push"


def test_a_push_staged_after_the_last_decode_step_is_not_lost_under_a_later_direct_push(models):
    """Staged while a generation ended (no decode step left to land it), then a push lands at once: the staged one
    lands first, under it, so the engine holds the newer weights and tag."""
    model, other, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    engine._generating = True  # the push meets a generation in its last step
    with engine.push_in_flight(1):
        engine.load_weights((n, p.detach()) for n, p in other.named_parameters())
    engine._generating = False
    with engine.push_in_flight(2):
        engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
    plan = _plan(tokenizer)
    completions = engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS)
    assert all((c.versions == 2).all() for group in completions for c in group)
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), model.parameters()))


def test_pushes_staged_in_a_row_keep_one_copy_and_the_newest_tensors(models):
    model, other, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    engine._generating = True
    named = dict(other.named_parameters())
    first, second = list(named)[:2], list(named)[1:3]
    for tag, names in ((1, first), (2, second)):
        with engine.push_in_flight(tag, recompute_kv=tag == 1):
            engine.load_weights((n, named[n].detach() * tag) for n in names)
    staged = engine._staged
    assert staged.tag == 2 and staged.recompute_kv and sorted(staged.weights) == sorted(set(first) | set(second))
    assert torch.equal(staged.weights[first[1]], named[first[1]].detach() * 2)  # the newer push's tensor
    assert torch.equal(staged.weights[first[0]], named[first[0]].detach())  # the earlier's, not pushed again


def test_a_producers_rounds_never_push_the_policy_when_its_version_moved(models):
    """A plan with a budget rule (V0.5's OSLA) runs rounds; with partial rollouts the trainer's push moves the
    engine's version between two of them. The producer's driver (`push_policy=False`) must not push the policy
    itself then: it would read the trainer's parameters mid-update, from the producer's thread."""
    from lit_rlvr.rewards.base import RewardRunner
    from lit_rlvr.rollout.driver import RolloutDriver
    from lit_rlvr.rollout.engine import SamplingConfig

    model, _, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    driver = RolloutDriver(engine, tokenizer, RewardRunner(lambda p, c, a: 0.0), SamplingConfig(max_new_tokens=4),
                           model)
    driver.push(step=0)
    pushes = []
    push = driver.weight_sync.push
    driver.weight_sync.push = lambda **kw: pushes.append(kw) or push(**kw)
    plan = _plan(tokenizer)
    rounds = iter([[1, 1, 1], None])

    def budget_rule(rollouts):  # a second round, after the trainer's push of version 1 moved the engine on
        driver.weight_sync.version = 1
        return next(rounds)

    plan.budget_rule = budget_rule
    out = driver.rollout(plan, step=0, seed_key=(0, 0), push_policy=False)
    assert pushes == [] and out.rollouts.num_samples == 3 * 2 + 3
    driver.weight_sync.version = 1
    plan.budget_rule, rounds = budget_rule, iter([[1, 1, 1], None])
    driver.rollout(plan, step=0, seed_key=(0, 0))  # the synchronous driver pushes what a round's step needs
    assert len(pushes) == 2


def _in_segments(engine, tokenizer, params, segment_tokens, between):
    plan = _plan(tokenizer)
    completions = generate_in_segments(engine.generate, plan.prompt_token_ids, plan.n_per_prompt, params,
                                       segment_tokens, between, tokenizer.eos_token_id)
    return rollouts_from_completions(plan, completions, source=0, pad_id=tokenizer.pad_token_id)


def test_segments_continue_each_completion_from_its_prefix_under_the_same_weights(models):
    """SGLang's and vLLM's way to take a push mid-batch (`lit_rlvr.rollout.segments`), run on the HF engine: the first
    segment is the unsegmented generation's start, and each later one continues from the prompt and the tokens so
    far, drawing from the same weights (their log-probs, to rounding)."""
    model, _, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    plan = _plan(tokenizer)
    whole = rollouts_from_completions(plan, engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS),
                                      source=0, pad_id=tokenizer.pad_token_id)
    one = _in_segments(engine, tokenizer, PARAMS, PARAMS.max_new_tokens, lambda: 0)
    assert torch.equal(one.response_ids, whole.response_ids) and torch.equal(one.old_logp, whole.old_logp)
    three = _in_segments(engine, tokenizer, PARAMS, 3, lambda: 0)
    assert torch.equal(three.response_ids[:, :3], whole.response_ids[:, :3])
    assert (three.token_version == 0).all() and three.response_mask.all()  # 8 tokens each (ignore_eos)
    assert torch.allclose(three.old_logp, _scored(model, three), atol=1e-4)


def _length_first(generate):
    """The HF engine's calls as SGLang and vLLM report them: both check a request's length before its stop tokens,
    so a completion that draws a stop token as its last allowed token says "length"."""
    def call(prompts, counts, params):
        out = generate(prompts, counts, params)
        for completion in (c for group in out for c in group):
            if len(completion.token_ids) == params.max_new_tokens:
                completion.finish_reason = "length"
        return out
    return call


def test_a_stop_token_drawn_last_in_a_segment_ends_the_completion(models):
    model, _, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    plan, stopping = _plan(tokenizer), SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    whole = engine.generate(plan.prompt_token_ids, plan.n_per_prompt, stopping)
    assert any(c.finish_reason == "stop" for group in whole for c in group)  # the model stops within 12 tokens
    for segment_tokens in (1, 4):  # with 1, every stop token is the last of its segment
        out = generate_in_segments(_length_first(engine.generate), plan.prompt_token_ids, plan.n_per_prompt,
                                   stopping, segment_tokens, lambda: 0, tokenizer.eos_token_id)
        for completion in (c for group in out for c in group):
            stops = (completion.token_ids == tokenizer.eos_token_id).nonzero().flatten().tolist()
            assert (completion.finish_reason, stops) in (("stop", [len(completion.token_ids) - 1]), ("length", []))
            assert completion.finish_reason == "stop" or len(completion.token_ids) == 12


def test_a_push_between_two_segments_draws_the_rest_from_the_new_weights(models):
    model, other, tokenizer = models
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    calls = []

    def between():  # the push lands before the second segment
        calls.append(1)
        if len(calls) == 2:
            engine.load_weights((n, p.detach()) for n, p in other.named_parameters())
        return 0 if len(calls) < 2 else 1

    swapped = _in_segments(engine, tokenizer, PARAMS, 3, between)
    assert (swapped.token_version[:, :3] == 0).all() and (swapped.token_version[:, 3:] == 1).all()
    assert torch.allclose(swapped.old_logp[:, :3], _scored(model, swapped)[:, :3], atol=1e-4)
    assert torch.allclose(swapped.old_logp[:, 3:], _scored(other, swapped)[:, 3:], atol=1e-4)  # prefix recomputed
    assert len(calls) == 3  # 8 tokens in segments of 3, 3 and 2


def _tag_from_the_trainers_thread(engine, tag: int) -> None:
    def trainer():
        with engine.push_in_flight(tag):
            pass
    thread = threading.Thread(target=trainer)
    thread.start()
    thread.join()


class _RequestsOnHF(SegmentedPushes, RolloutEngine):
    """`SegmentedPushes` (SGLang's and vLLM's in-flight pushes) over an HF engine that stands for their servers: a
    call generates whole requests, and pushes go through the mixin's staging."""

    def __init__(self, hf: HFEngine, segment_tokens: int, eos_id: int):
        self._hf = hf
        self._init_segments(segment_tokens, eos_id)

    def load_weights(self, named_tensors):
        if self._staged_call("load_weights", named_tensors):
            return
        self._hf.load_weights(named_tensors)

    def end_weight_update(self):
        self._staged_call("end_weight_update")

    def generate(self, prompt_token_ids, n_per_prompt, params):
        return self._generate_with_pushes(self._hf.generate, prompt_token_ids, n_per_prompt, params)


def test_a_push_staged_while_a_request_engine_generates_lands_at_the_next_segment(models):
    model, other, tokenizer = models
    hf = HFEngine(copy.deepcopy(model), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    engine = _RequestsOnHF(hf, segment_tokens=3, eos_id=tokenizer.eos_token_id)
    plan = _plan(tokenizer)
    untagged = engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS)
    assert all(c.versions is None for group in untagged for c in group)  # no tagged push: whole requests
    _tag_from_the_trainers_thread(engine, 0)  # as the pipeline does: the trainer's thread pushes, another generates
    generate, calls, untouched = hf.generate, [], []

    def generate_then_push(*args):
        out = generate(*args)
        calls.append(1)
        if len(calls) == 1:  # the trainer's thread pushes while the first segment's results are in
            def trainer():
                with engine.push_in_flight(1):
                    engine.load_weights((n, p.detach()) for n, p in other.named_parameters())
                    engine.end_weight_update()
                untouched.append(not any(torch.equal(p, q) for p, q in zip(hf.model.parameters(),
                                                                            other.parameters())))
            thread = threading.Thread(target=trainer)
            thread.start()
            thread.join()
        return out

    hf.generate = generate_then_push
    swapped = rollouts_from_completions(plan, engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS),
                                        source=0, pad_id=tokenizer.pad_token_id)
    assert untouched == [True]  # the push was staged: the engine's weights stayed until the next segment
    assert (swapped.token_version[:, :3] == 0).all() and (swapped.token_version[:, 3:] == 1).all()
    assert torch.allclose(swapped.old_logp[:, 3:], _scored(other, swapped)[:, 3:], atol=1e-4)
    assert all(torch.equal(p, q) for p, q in zip(hf.model.parameters(), other.parameters()))
    # a staged push that fails lands nothing; two that succeed land in order, the later one's weights last
    engine._generating = True
    with pytest.raises(KeyError):
        with engine.push_in_flight(2):
            engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
            raise KeyError("the push failed")
    for tag, weights in ((3, model), (4, other)):
        with engine.push_in_flight(tag):
            engine.load_weights((n, p.detach()) for n, p in weights.named_parameters())
    assert [push.tag for push in engine._staged] == [3, 4]
    engine._generating = False
    # the pushing thread's own generation (an evaluation, the post-push check) lands them, in whole requests
    evaluation = engine.generate(plan.prompt_token_ids, plan.n_per_prompt, PARAMS)
    assert engine._tag == 4 and engine._staged == [] and all(c.versions is None for g in evaluation for c in g)
    assert all(torch.equal(p, q) for p, q in zip(hf.model.parameters(), other.parameters()))
