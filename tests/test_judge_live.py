"""The LLM judge (`reward=judge`) live against vLLM's OpenAI-compatible server on the CPU, in the vLLM stage
(`bash scripts/vllm_cpu_env.sh VENV && VENV/bin/python -m pytest -m live_vllm`).

The judge model is the live tests' tiny architecture (2 heads of 32 dims, what vLLM's CPU attention accepts) with
weights set so that its first answer token is always `y` or `n` with known odds: one residual dimension carries a
constant that no layer writes, the final norm keeps only that dimension, and the output head reads it into `y` and
`n` alone. The score is then P(y) / (P(y) + P(n)) of a real forward, which the test recomputes with transformers
on the same rendered prompt. The server: `python -m vllm.entrypoints.openai.api_server`, the process `vllm serve`
runs (vllm-cpu's `vllm` command looks its version up under the distribution name `vllm` and fails to start).
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

try:
    import openai  # noqa: F401
    import vllm  # noqa: F401

    LIVE_ERROR = None
except Exception as err:  # ImportError, or a CUDA-linked dependency that fails to load
    LIVE_ERROR = f"vllm or openai does not import here ({err!r:.200}); build: bash scripts/vllm_cpu_env.sh VENV"

pytestmark = [pytest.mark.live_vllm, pytest.mark.skipif(LIVE_ERROR is not None, reason=str(LIVE_ERROR))]

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
SERVED_NAME = "judge"


def build_judge(path: Path) -> Path:
    """Save the judge model described in the module docstring (and its chat template) under `path`."""
    from transformers import Qwen3ForCausalLM

    from lit_rlvr.models.tiny import build_tokenizer, save, tiny_config

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = tiny_config(len(tokenizer), hidden_size=64, heads=2)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    carrier = 0  # the residual dimension that holds the constant
    with torch.no_grad():
        model.model.embed_tokens.weight[:, carrier] = 10.0
        for layer in model.model.layers:  # no layer writes the carrier
            layer.self_attn.o_proj.weight[carrier] = 0.0
            layer.mlp.down_proj.weight[carrier] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[carrier] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("y"), carrier] = 1.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("n"), carrier] = 0.9
    return save(model.eval(), tokenizer, path)


def reference_yes_probability(model_dir: Path, content: str) -> float:
    """P(y) / (P(y) + P(n)) for the next token after the chat-rendered `content`, computed with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0, -1].log_softmax(-1)
    y, n = (logprobs[tokenizer.convert_tokens_to_ids(t)].exp().item() for t in "yn")
    return y / (y + n)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    return build_judge(tmp_path_factory.mktemp("judge"))


@pytest.fixture(scope="module")
def server(judge_dir, tmp_path_factory):
    """The judge served by vLLM on the CPU; yields (base_url, process). Stopped (its whole session) afterwards."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("judge_server") / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge_dir),
         "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "256", "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    try:
        while True:
            assert proc.poll() is None, f"the vLLM server exited: {Path(log.name).read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the vLLM server did not start: {Path(log.name).read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=2) as response:
                    if SERVED_NAME in response.read().decode():
                        break
            except OSError:
                time.sleep(1.0)
        yield base_url, proc
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _judge(base_url: str, **options):
    from lit_rlvr.rewards.judge import JudgeReward

    return JudgeReward(base_url=base_url, model=options.pop("model", SERVED_NAME), **options)


def _score(judge, prompt="2+3=", completion="5", answer="5"):
    """One judged completion (a judge's client belongs to the event loop that first awaits it: one judge, one
    call here)."""
    async def once():
        return await judge(prompt, completion, answer)

    return asyncio.run(once())


def test_yes_probability_is_the_models_own_and_lies_in_0_1(server, judge_dir):
    base_url, _ = server
    for prompt, completion, answer in (("2+3=", "5", "5"), ("7*8=", "54", "56")):
        judge = _judge(base_url)
        result = _score(judge, prompt, completion, answer)
        assert not result.malformed, result
        content = judge.template.format(prompt=prompt, completion=completion, answer=answer)
        assert 0.0 < result.score < 1.0
        assert result.score == pytest.approx(reference_yes_probability(judge_dir, content), abs=1e-4)


def test_failure_rules_live(server):
    """Through the reward runner train.py uses: a model the server does not serve (an API error: malformed and
    counted as a reward failure) and free text with no number (malformed, not a failure); neither raises, and the
    other completions of the batch keep their scores."""
    from lit_rlvr.rewards import build_reward_runner

    base_url, _ = server
    unknown = build_reward_runner("judge", {"base_url": base_url, "model": "no-such-model", "retries": 0})
    batch = unknown(["2+3="], ["5"], ["5"])
    unknown.close()
    assert batch.malformed.tolist() == [True] and batch.failures == 1
    parsed = build_reward_runner("judge", {"base_url": base_url, "model": SERVED_NAME, "score": "parsed",
                                           "max_tokens": 4})
    batch = parsed(["2+3=", "7*8="], ["5", "54"], ["5", "56"])  # this judge only ever says y or n
    parsed.close()
    assert batch.malformed.tolist() == [True, True] and batch.failures == 0
    assert batch.scores.tolist() == [0.0, 0.0]


def test_train_py_with_the_judge_and_a_dead_judge(server, tmp_path):
    """`train.py reward=judge` trains 2 steps with every reward from the server; then the same run against a
    server that is gone stops before any work in one line naming the URL."""
    base_url, proc = server
    from lit_rlvr.models.tiny import build_tiny, save

    policy = save(*build_tiny(0, hidden_size=64, heads=2), tmp_path / "policy")
    common = [sys.executable, "train.py", "reward=judge", f"model.name_or_path={policy}", "data.batch_size=4",
              "data.num_test=4", "algorithm.group_size=2", "callbacks.progress=null", "trainer.max_steps=2",
              f"reward.options.model={SERVED_NAME}"]
    run_dir = tmp_path / "run"
    done = subprocess.run([*common, f"reward.options.base_url={base_url}", f"hydra.run.dir={run_dir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("reward/mean")]
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= float(row["reward/mean"]) <= 1.0
        assert float(row["reward/malformed_frac"]) == 0.0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2

    _stop(proc)
    refused = subprocess.run([*common, f"reward.options.base_url={base_url}", f"hydra.run.dir={tmp_path / 'r2'}"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert base_url in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "r2" / "metrics.csv").exists()
