"""`SGLangServerEngine` (`engine=sglang_server`): rollouts from SGLang servers started outside the run
(`lit-rlvr-serve --engine sglang`, i.e. `python -m sglang.launch_server --skip-tokenizer-init`), over HTTP. Tested
live with sglang==0.5.23 on a CPU.

Sampling: `/generate` with token ids in and out, one call per prompt with its samples as a batch (a group stays
on one server: its prefix cache), each sample with its own seed, `return_logprob` (log softmax(logits / T) of the
sampled token, as the colocated `SGLangEngine`: lit_rlvr.rollout.sglang's request and parse functions).

Weights (`engine.options.weight_transfer`): `disk`, SGLang's `/update_weights_from_disk` on a folder the trainer
wrote (config + a safetensors file per bucket; on the server's filesystem), between `/pause_generation` and
`/continue_generation`; it flushes the server's prefix cache itself. The server's identity is the model it was
started on (`/server_info`), which a weight update does not change.
"""

from __future__ import annotations

import os
from typing import Sequence


from lit_rlvr.rollout.engine import Completion, SamplingParams
from lit_rlvr.rollout.server import ServerEngine
from lit_rlvr.rollout.sglang import build_requests, parse_outputs


class SGLangServerEngine(ServerEngine):
    """`RolloutEngine` over SGLang servers (see the module docstring and `ServerEngine` for the options)."""

    _KIND = "SGLang"
    _WEIGHT_TRANSFERS = ("disk",)

    def _identify(self, url: str) -> str:
        info = self._pool.get(url, "/server_info", timeout=self._pool.connect_timeout_s)
        if not isinstance(info, dict) or "model_path" not in info or "version" not in info:
            raise ValueError("GET /server_info does not describe an SGLang server")
        if not info.get("skip_tokenizer_init"):
            raise ValueError("it was started without --skip-tokenizer-init (token ids in and out); start it with "
                             "lit-rlvr-serve --engine sglang")
        return str(info["model_path"])

    def _sample(self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int],
                params: SamplingParams) -> list[list[Completion]]:
        rows, sampling = build_requests(prompt_token_ids, n_per_prompt, params, self._eos_id)
        starts = [sum(n_per_prompt[:b]) for b in range(len(n_per_prompt))]

        def job(b: int):
            span = slice(starts[b], starts[b] + n_per_prompt[b])

            def call(url: str) -> list[Completion]:
                answer = self._pool.post(url, "/generate", {"input_ids": rows[span], "sampling_params": sampling[span],
                                                           "return_logprob": True})
                (completions,) = parse_outputs(answer, [n_per_prompt[b]])
                return completions
            return call

        jobs = [(b, job(b)) for b in range(len(n_per_prompt)) if n_per_prompt[b] > 0]
        done = iter(self._pool.run(jobs, "generating"))
        return [next(done) if n > 0 else [] for n in n_per_prompt]

    def _stage(self, folder: str, files: list[str]) -> str:
        """The folder of the bucket files, with the policy's config beside them (SGLang loads every
        `*.safetensors` of a folder that has no index)."""
        for name, content in self._config_files.items():
            if name.endswith(".json"):
                with open(os.path.join(folder, name), "wb") as handle:
                    handle.write(content)
        return folder

    def _update(self, url: str, folder: str) -> None:
        """One server loads the folder, paused around it (in-flight requests kept, resumed after); resumed even
        when the load fails, so no server is left paused."""
        post = self._pool.post
        post(url, "/pause_generation", {"mode": "retract"}, timeout=self._push_timeout_s)
        try:
            answer = post(url, "/update_weights_from_disk", {"model_path": folder, "flush_cache": True,
                                                             "weight_version": str(self._pushes)},
                          timeout=self._push_timeout_s)
            if not (answer or {}).get("success"):
                raise RuntimeError(f"{url}/update_weights_from_disk did not load {folder}: {answer!r}")
        finally:
            post(url, "/continue_generation", {}, timeout=self._push_timeout_s)

