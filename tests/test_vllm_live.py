"""vLLM itself, live on this machine (`bash scripts/vllm_cpu_env.sh VENV && VENV/bin/python -m pytest -m live_vllm`).

VLLMEngine against HFEngine on one policy (greedy tokens equal, fp32 behaviour log-probs within 1e-5 of the
policy's forward at the sampling temperature), weight pushes (perturbed weights -> outputs follow; the prefix
cache does not serve KV of the old weights), and `train.py engine=vllm_cpu` for GRPO, C3PO with V0.5 (one run),
resume, and 1 vs 2 ranks. The policy is the tiny architecture with 2 heads of 64/2 = 32 dims: vLLM's CPU
attention refuses the default tiny model's head_dim 16. Every engine process must be gone when its owner is.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401

    VLLM_ERROR = None
except Exception as err:  # ImportError, or a CUDA-linked dependency that fails to load
    VLLM_ERROR = f"vllm does not import here ({err!r:.200}); build the environment: bash scripts/vllm_cpu_env.sh VENV"

pytestmark = [pytest.mark.live_vllm, pytest.mark.skipif(VLLM_ERROR is not None, reason=str(VLLM_ERROR))]

REPO = Path(__file__).resolve().parents[1]
CPU_ENGINE = ["engine=vllm_cpu", "engine.options.kv_cache_memory_bytes=67108864"]  # 64 MiB: ample for these runs
TIMING = ("time/", "perf/")


@pytest.fixture(scope="module")
def policy():
    from lit_rlvr.models.tiny import build_tiny

    model, tokenizer = build_tiny(0, hidden_size=64, heads=2)  # head_dim 32
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def policy_dir(policy, tmp_path_factory) -> Path:
    """The untrained head_dim-32 policy, saved. (A 400-step warm-up with 2 heads still scored -1 on every sample
    of these small runs: no gradient either way, and 8 minutes of warm-up under load.)"""
    from lit_rlvr.models.tiny import save

    return save(*policy, tmp_path_factory.mktemp("vllm_policy"))


@pytest.fixture(scope="module")
def engine(policy):
    from lit_rlvr.rollout.vllm import VLLMEngine
    from lit_rlvr.rollout.weights import push_weights

    model, tokenizer = policy
    eng = VLLMEngine(model, tokenizer, kv_cache_memory_bytes=64 << 20, dtype="float32", enforce_eager=True)
    push_weights(eng, model, bucket_bytes=4096)  # small buckets: fused layers span several
    yield eng
    pids = eng.engine_pids()
    eng.shutdown()
    assert not _alive(pids, grace_s=20), "engine processes outlived shutdown()"


def _alive(pids, grace_s: float = 0.0) -> list[int]:
    """Those of `pids` still running (a zombie, dead but not yet reaped, is not), after up to `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [p for p in pids if _state(p) not in ("Z", "X", "")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, Z, ...); "" when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["12+34=", "7-3=", "Q: 91+9? A:", "the quick brown fox " * 12]  # the last is a 240-token prompt
    return [tokenizer(t)["input_ids"] for t in texts]


def _policy_logprobs(model, prompt: list[int], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of `tokens` after `prompt`, by the policy's own forward."""
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, tokens[:, None]).squeeze(-1)


def test_greedy_matches_hf_engine_and_logprobs_match_the_policy(engine, policy):
    from lit_rlvr.rollout import SamplingParams
    from lit_rlvr.rollout.hf import HFEngine

    model, tokenizer = policy
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ours = engine.generate(prompts, [1] * len(prompts), params)
    hf = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(
        prompts, [1] * len(prompts), params)
    for (a,), (b,) in zip(ours, hf):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_seeded_sampling_repeats_and_logprobs_are_at_the_temperature(engine, policy):
    from lit_rlvr.rollout import SamplingParams

    model, tokenizer = policy
    prompts = _prompts(tokenizer)[:3]
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=16, seed=11)
    first = engine.generate(prompts, [3, 1, 2], params)
    # the same seed, another batch (prompt order and companions differ): the same completions per prompt
    again = engine.generate(prompts[::-1], [2, 1, 3], params)[::-1]
    other = engine.generate(prompts, [3, 1, 2], SamplingParams(temperature=0.7, max_new_tokens=16, seed=12))
    assert [len(c) for c in first] == [3, 1, 2]
    for per_a, per_b in zip(first, again):
        assert [c.token_ids.tolist() for c in per_a] == [c.token_ids.tolist() for c in per_b]
    assert len({tuple(c.token_ids.tolist()) for c in first[0]}) > 1  # rows of one prompt draw differently
    assert [c.token_ids.tolist() for c in first[0]] != [c.token_ids.tolist() for c in other[0]]
    for prompt, per in zip(prompts, first):
        for c in per:
            assert torch.allclose(c.logprobs, _policy_logprobs(model, prompt, c.token_ids, 0.7), atol=1e-5)


def test_stop_tokens_end_a_completion_with_the_stop_token(engine, policy):
    from lit_rlvr.rollout import SamplingParams

    model, tokenizer = policy
    prompt = _prompts(tokenizer)[0]
    (greedy,), = engine.generate([prompt], [1], SamplingParams(temperature=0.0, max_new_tokens=12))
    stop = int(greedy.token_ids[2])  # the third greedy token, as a stop token
    (cut,), = engine.generate([prompt], [1], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,)))
    first = greedy.token_ids.tolist().index(stop)
    assert cut.finish_reason == "stop" and cut.token_ids.tolist() == greedy.token_ids.tolist()[: first + 1]


def test_pushed_weights_change_the_outputs_and_the_prefix_cache_is_not_reused(engine, policy):
    """Perturbed weights in 4 KiB buckets: vLLM's greedy tokens and log-probs follow the new policy, also for a
    long prompt that was just cached under the old weights."""
    from lit_rlvr.rollout import SamplingParams
    from lit_rlvr.rollout.hf import HFEngine
    from lit_rlvr.rollout.weights import push_weights

    model, tokenizer = policy
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate(prompts, [1] * len(prompts), params)
    perturbed = type(model)(model.config).eval()
    perturbed.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        push_weights(engine, perturbed, bucket_bytes=4096)
        after = engine.generate(prompts, [1] * len(prompts), params)
        hf = HFEngine(perturbed, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(
            prompts, [1] * len(prompts), params)
    finally:
        push_weights(engine, model, bucket_bytes=4096)  # the other tests' policy
    assert any(a[0].token_ids.tolist() != b[0].token_ids.tolist() for a, b in zip(after, before))
    for (a,), (b,) in zip(after, hf):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


KILLED_OWNER = """
import json, sys, time
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.rollout.vllm import VLLMEngine
if __name__ == "__main__":
    engine = VLLMEngine(*build_tiny(0, hidden_size=64, heads=2), kv_cache_memory_bytes=16 << 20, enforce_eager=True)
    print("PIDS", json.dumps(engine.engine_pids() + engine.worker_pids()), flush=True)
    time.sleep(600)
"""


def test_engine_processes_die_when_their_owner_is_killed(tmp_path):
    """SIGKILL leaves no chance to shut down: the engine core and its worker must still go."""
    script = tmp_path / "owner.py"
    script.write_text(KILLED_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        line = next(line for line in owner.stdout if line.startswith("PIDS "))  # vLLM logs to stdout too
        pids = json.loads(line.removeprefix("PIDS "))
        assert len(pids) >= 2 and not set(pids) - set(_alive(pids))  # engine core and worker run
        owner.kill()
        owner.wait()
        assert not _alive(pids, grace_s=30)
    finally:
        try:
            os.killpg(owner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_in_process_mode_is_refused(policy, monkeypatch):
    from lit_rlvr.rollout.vllm import VLLMEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMEngine(*policy)


# -- train.py ------------------------------------------------------------------------------------------------
# An untrained head_dim-32 policy (vLLM's CPU attention refuses the tiny model's head_dim 16) scores -1 on every
# arithmetic problem; a reward that varies within groups gives these runs advantages, gradients and moving weights.
COMMON = ["data.batch_size=8", "data.num_test=16", "algorithm.group_size=4", "callbacks.progress=null",
          "reward.name=tests.reward_helpers:digit_share"]
FSDP_CPU = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy.param_dtype=float32"]
C3PO_V05 = ["algorithm=c3po_v05", "algorithm.callbacks.value_prior.min_context=4",
            "algorithm.callbacks.value_prior.k_max=8"]


def _train(run_dir: Path, policy_dir: Path, overrides: list[str], steps: int, ranks: int = 1) -> Path:
    """`train.py`, its processes tagged through the environment (torchrun's workers and vLLM's engine cores
    inherit it, even when they start sessions of their own); afterwards none of them may remain."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    cmd = [*launcher, "train.py", *CPU_ENGINE, f"model.name_or_path={policy_dir}", *COMMON, *overrides,
           f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    tag = f"{run_dir}:{time.monotonic_ns()}"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "LIT_RLVR_TEST_TAG": tag})
    try:
        out, _ = proc.communicate(timeout=1500)
    finally:
        leftover = _alive(_tagged(tag), grace_s=30)
        for pid in _tagged(tag):  # whatever is left, also after a failure or a timeout
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-5000:]
    assert not leftover, f"processes of {run_dir.name} outlived train.py: {leftover}"
    return run_dir


def _tagged(tag: str) -> list[int]:
    """Processes whose environment holds LIT_RLVR_TEST_TAG=tag."""
    needle = f"LIT_RLVR_TEST_TAG={tag}".encode() + b"\0"
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if needle in environ.read_bytes() + b"\0":
                pids.append(int(environ.parent.name))
    return pids


def _rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("reward/mean")]
    return [{k: None if v == "nan" else float(v) for k, v in r.items() if v != "" and not k.startswith(TIMING)}
            for r in rows]


@pytest.fixture(scope="module", autouse=True)
def background_runs(request, policy_dir, tmp_path_factory):
    """The train.py runs, started with the module's first test when a selected test needs them, and going on in the
    background while the engine tests run, two at a time: a run is mostly single-threaded start-up (imports, engine
    processes), so two side by side on two cores take much less than twice one. The resumed run's second half
    follows its first. Yields their directories and their futures (`runs` waits for them)."""
    if not any("runs" in item.fixturenames for item in request.session.items if item.module is request.module):
        yield None
        return
    base = tmp_path_factory.mktemp("vllm_train")
    out = {"grpo": base / "grpo", "grpo_resumed": base / "grpo_resumed", "grpo_two_ranks": base / "two_ranks",
           "c3po_v05": base / "c3po_v05", "async": base / "async"}

    def resumed():
        _train(out["grpo_resumed"], policy_dir, [], steps=2)
        _train(out["grpo_resumed"], policy_dir, [f"resume={out['grpo_resumed']}/checkpoints/last.ckpt"], steps=3)

    jobs = [resumed,  # the longest chains first
            lambda: _train(out["grpo_two_ranks"], policy_dir, FSDP_CPU, steps=3, ranks=2),
            lambda: _train(out["grpo"], policy_dir, [], steps=3),
            # both papers' callbacks in one run (C3PO's weight-sample pushes, V0.5's prior): one vLLM start, not two
            lambda: _train(out["c3po_v05"], policy_dir, [*C3PO_V05], steps=3),
            # the producer generates the next batch while the trainer updates; each push lands in the batch being
            # generated (partial rollouts), between two segments of 4 tokens; every second push is checked
            lambda: _train(out["async"], policy_dir, ["rollout.mode=async", "rollout.max_staleness=1",
                                                      "eval_before=false", "rollout.partial_rollout=true",
                                                      "rollout.kv_at_swap=recompute", "engine.options.segment_tokens=4",
                                                      "engine.options.sync_check_every=2"], steps=3)]
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield out, [pool.submit(job) for job in jobs]
    finally:
        pool.shutdown(wait=True)  # each run ends (or times out) and is checked for leftover processes by _train


@pytest.fixture(scope="module")
def runs(background_runs):
    out, jobs = background_runs
    for job in jobs:
        job.result()  # a failed run's assertion
    return out


@pytest.mark.parametrize("name,algorithm,steps", [("grpo", "grpo", 3), ("c3po_v05", "c3po_v05", 3)])
def test_train_with_vllm_writes_summary_metrics_and_checkpoint(runs, name, algorithm, steps):
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert summary["algorithm"] == algorithm and summary["steps"] == steps
    if "v05" not in algorithm:  # V0.5's budget rule decides how many rollouts each prompt gets
        assert summary["rollouts_total"] == steps * 8 * 4
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert (runs[name] / "checkpoints" / "last.ckpt").stat().st_size > 0
    rows = _rows(runs[name])
    assert len(rows) == steps and all(r["response/len_mean"] > 0 for r in rows)
    assert all(r["groups/zero_adv_frac"] < 1.0 and r["grad/norm"] > 0 for r in rows)  # it trained: not a no-op
    kl = [r.get("mismatch/kl") for r in rows]  # the engine's drift: logged and finite at every step
    assert all(v is not None and math.isfinite(v) and v >= 0 for v in kl), kl


def test_behaviour_logprobs_from_vllm_equal_the_trainers(runs):
    """Step 1 of GRPO: the engine holds the trainer's weights, so vLLM's log-probs and the trainer's agree and
    the PPO ratio is 1 (approx KL ~ 0, nothing clipped)."""
    first = _rows(runs["grpo"])[0]
    assert abs(first["loss/approx_kl"]) < 1e-6 and first["loss/pg_clipfrac"] == 0.0
    # every GRPO step's loss forward runs at the weights vLLM sampled with: its drift is fp32 rounding (k3 ~ 1e-11)
    assert all(r["mismatch/kl"] < 1e-8 and abs(r["mismatch/is_weight_max"] - 1) < 1e-3 for r in _rows(runs["grpo"]))


def test_v05_prior_is_present_and_c3po_samples_weights(runs):
    rows = _rows(runs["c3po_v05"])
    assert rows[-1]["v05/prior_present"] == 1.0
    assert all(r["noise/numel"] > 0 and r["noise/param_delta_rms"] > 0 for r in rows)  # sampled weights generated


def test_async_with_vllm_trains_one_batch_behind_the_engine(runs):
    rows = _rows(runs["async"])
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(r["loss/policy"]) for r in rows)
    # a gradient wherever a group's rewards differ (a batch of uniform groups has none: GRPO's advantages are 0)
    assert all(r["grad/norm"] > 0 for r in rows if r["groups/zero_adv_frac"] < 1)
    assert all(0 <= r["async/partial_frac"] <= 1 for r in rows)  # (how many span two versions: the machine's timing)
    assert any(r.get("engine/sync_logp_diff") is not None for r in rows)  # the post-push check (every second push)


def test_resume_with_vllm_continues_exactly(runs):
    """The engine gets the restored weights before step 3 and samples with the same seed: same rows."""
    assert _rows(runs["grpo_resumed"]) == _rows(runs["grpo"])


def test_two_ranks_sample_what_one_rank_samples(runs):
    """Same seed, same global batch: each completion is keyed by its prompt, not its rank or batch, so the
    rollouts are identical; sums are split across ranks differently (float rounding, as in test_fsdp)."""
    two, one = _rows(runs["grpo_two_ranks"]), _rows(runs["grpo"])
    assert len(two) == len(one) == 3
    for step, (a, b) in enumerate(zip(two, one)):
        assert a.keys() == b.keys()
        for key in ("response/len_mean", "response/len_max", "rollouts/total"):  # same completions
            assert a[key] == b[key], (step, key)
        # same rewards; their mean is summed across ranks in another order
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], rel=1e-6), step
        for key in a.keys() - {"micro/count", "micro/padding_frac"}:  # each rank's own micro-batch layout
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key)


def test_multi_turn_rollouts_equal_hf(engine, policy):
    """Multi-turn rollouts continue from token ids on vLLM as on HF: greedy transcripts token for token (vLLM runs
    past the stop string, the loop cuts it), sampled ones consistent with the policy's forward."""
    from multi_turn_live import assert_greedy_transcripts_equal_hf, assert_sampled_rollouts_are_consistent

    model, tokenizer = policy
    assert_greedy_transcripts_equal_hf(engine, model, tokenizer)
    assert_sampled_rollouts_are_consistent(engine, model, tokenizer)


def test_a_push_made_while_vllm_generates_lands_between_two_segments(engine, policy):
    """rollout.partial_rollout=true on vLLM (lit_rlvr.rollout.segments): the push is staged, lands before the next
    segment, and the tokens after it are the new weights' greedy ones, each tagged with its version."""
    from in_flight_live import assert_a_push_mid_generation_lands_between_segments_as_on_hf

    model, tokenizer = policy
    assert_a_push_mid_generation_lands_between_segments_as_on_hf(engine, model, tokenizer, bucket_bytes=4096)
