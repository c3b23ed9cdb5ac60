"""Methods mixed into vLLM's worker (`worker_extension_cls`), run in the engine-core process by `collective_rpc`.

vLLM's RPC encodes a tensor in plain kwargs as a list, and a callable only under
VLLM_ALLOW_INSECURE_SERIALIZATION=1; a bucket therefore travels as one safetensors blob (bytes) and is decoded
here, then loaded by vLLM's own `reload_weights` from checkpoint (HF) names, which repacks each layer for its
kernels.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from lit_rlvr.run.processes import pid_alive

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WeightReceiver:
    def lit_rlvr_reload(self, blob: bytes) -> int:
        """Load one bucket (a `safetensors.torch.save` blob of HF-named tensors); returns how many tensors."""
        from safetensors.torch import load

        weights = load(blob)
        self.reload_weights(weights_iterator=list(weights.items()), is_checkpoint_format=True)
        if any(name.endswith("embed_tokens.weight") for name in weights):
            retie(self.model_runner.get_model(), self.model_runner.model_config)
        return len(weights)

    def lit_rlvr_die_with(self, owner_pid: int) -> bool:
        """End this worker and its engine core (its parent) when the trainer process `owner_pid` dies, even by
        SIGKILL: a killed trainer or test must not leave an engine holding memory. Linux's parent-death signal
        covers a dead engine core; a watcher thread covers the trainer, which is not this process's parent."""
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        engine_core = os.getppid()

        def watch() -> None:
            while pid_alive(owner_pid):
                time.sleep(1.0)
            if engine_core != 1:
                os.kill(engine_core, signal.SIGKILL)
            os._exit(1)

        threading.Thread(target=watch, name="lit_rlvr_owner_watch", daemon=True).start()
        return True


def retie(model, model_config) -> None:
    """A tied LM head keeps the weight it had before a reload (vLLM's reload replaces the embedding's parameter, not
    the head's alias of it; the layerwise reload of a server loads nothing into the head): point it at the new
    embedding and let the head's method redo its kernel copy (the CPU backend packs it). Colocated engines
    (`WeightReceiver`) and servers (`vllm_server_worker`) alike."""
    if not getattr(model_config.hf_text_config, "tie_word_embeddings", False):
        return
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        raise RuntimeError(f"tied embeddings in {type(model).__name__}, but no lm_head / model.embed_tokens to "
                           "re-tie after a weight update")
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
