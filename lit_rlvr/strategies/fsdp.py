"""`FSDP2Strategy`: FSDP2 training; the rollout engine beside each rank is the module's, this strategy shards the
policy and saves sharded optimizer state (docs/architecture.md §7).

Lightning's `ModelParallelStrategy` runs the processes, the device mesh and the (full or sharded) checkpoints;
this subclass shards the policy and the frozen reference with `fully_shard` per decoder block, all on one
data-parallel mesh dimension. The rest of the distributed RL step lives where it belongs:
* `GRPOModule.configure_model` calls `parallelize` (Lightning's hook for model parallelism);
* each rank generates for its own prompts (the datamodule splits the global batch over ranks) with its own
  engine, built before sharding (`copy` mode or SGLang; `shared` cannot sample with sharded weights);
* weights reach the engines through `rollout.weights.push_weights`, which gathers each parameter from its
  shards (`DTensor.full_tensor`), casts it and sends size-capped buckets by HF name, after every optimizer
  step and for every 3PO weight sample; engines sleep while the trainer needs the memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lit_rlvr.run import distributed as D

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLAT_OPTIMIZER_STATES = "flat_optimizer_states"  # checkpoint key: per-rank states of flat-state optimizers


def has_flat_state(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers whose state is not keyed by parameter (IVON keeps flat per-group tensors and
    optimizer-wide statistics): torch's distributed state-dict helpers cannot map such state to names."""
    return any(not isinstance(key, torch.Tensor) for key in optimizer.state)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, found by the class names transformers lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no decoder blocks to shard (its _no_split_modules is "
                         f"{sorted(names) or 'empty'}); FSDP2Strategy shards a transformers causal LM per block")
    return blocks


def shard_model(model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                activation_checkpointing: bool, cpu_offload: bool, reshard_after_forward: bool) -> None:
    """`fully_shard` every decoder block, then the root (embeddings, final norm, head), in place.

    Parameters stay in fp32 (the master weights the optimizer updates); forward and backward compute in
    `param_dtype` and gradients are reduced in `reduce_dtype` (FSDP2's MixedPrecisionPolicy).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if any(p.dtype != torch.float32 for p in model.parameters()):
        log.info("FSDP2Strategy: keeping fp32 master weights (the model was loaded in another dtype)")
        model.float()
    if activation_checkpointing:
        # transformers' own switch recomputes each block in backward and keeps parameter names unchanged
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    options: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        reshard_after_forward=reshard_after_forward,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for block in decoder_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all ranks (pure data parallelism with sharded parameters, gradients and optimizer state).

    Args: `param_dtype` compute dtype (`bfloat16` on GPUs; `float32` for exact CPU tests); `reduce_dtype` of
    the gradient reduce-scatter; `activation_checkpointing`; `cpu_offload` (parameters, gradients and optimizer
    state in host memory); `reshard_after_forward` (free gathered weights after forward: less memory, one more
    all-gather in backward); `save_distributed_checkpoint` (one file per rank instead of one `last.ckpt`);
    other keyword arguments go to `ModelParallelStrategy` (e.g. `process_group_backend`, `timeout`).
    """

    def __init__(self, *, param_dtype: str = "bfloat16", reduce_dtype: str = "float32",
                 activation_checkpointing: bool = False, cpu_offload: bool = False,
                 reshard_after_forward: bool = True, save_distributed_checkpoint: bool = False, **kwargs: Any):
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value not in DTYPES:
                raise ValueError(f"trainer.strategy.{key}={value!r}; valid: {', '.join(DTYPES)}")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.param_dtype, self.reduce_dtype = DTYPES[param_dtype], DTYPES[reduce_dtype]
        self.activation_checkpointing, self.cpu_offload = activation_checkpointing, cpu_offload
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # every rank is one data-parallel shard: the mesh is world × 1 (no tensor parallelism)
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def parallelize(self, module: Any) -> None:
        """Shard the module's `policy` (and `ref_policy`, if any) once; called from `configure_model`."""
        if getattr(module, "_fsdp_sharded", False):
            return
        if module.engine is not None and module.engine.shares_weights:
            raise ValueError("engine.options.mode=shared samples with the trainer's own weights, which FSDP shards: "
                             "use engine.options.mode=copy (CPU, tests) or engine=sglang (GPUs)")
        mesh = self.device_mesh["data_parallel"]
        for model in (module.policy, getattr(module, "ref_policy", None)):
            if model is not None:
                shard_model(model, mesh, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                            activation_checkpointing=self.activation_checkpointing and model is module.policy,
                            cpu_offload=self.cpu_offload, reshard_after_forward=self.reshard_after_forward)
        module._fsdp_sharded = True

    # -- checkpoints: optimizers with flat, shard-local state (IVON) are saved per rank ---------------------
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not has_flat_state(optimizer):
            return super().optimizer_state(optimizer)
        return {FLAT_OPTIMIZER_STATES: D.all_gather_object(optimizer.state_dict())}  # each rank's own shard

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # kept beside the model state (not in the distributed-checkpoint tensors), in both checkpoint layouts
        states = checkpoint.get("optimizer_states", [])
        flat = [s.pop(FLAT_OPTIMIZER_STATES) for s in states if FLAT_OPTIMIZER_STATES in s]
        if flat:
            checkpoint["optimizer_states"] = [s for s in checkpoint["optimizer_states"] if s]
            checkpoint[FLAT_OPTIMIZER_STATES] = flat
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Lightning's resume path for this strategy does not pass `fit(weights_only=...)` on; our checkpoints
        # hold the run config (omegaconf) and RNG states, which train.py loads with weights_only=False too
        weights_only = False if weights_only is None else weights_only
        if not any(has_flat_state(o) for o in self.optimizers):
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        path = Path(self.broadcast(checkpoint_path))
        checkpoint = _load_checkpoint(path=path, state={"state_dict": self.model},
                                      strict=self.lightning_module.strict_loading,
                                      optimizer_states_from_list=True, weights_only=weights_only)
        for optimizer, per_rank in zip(self.optimizers, checkpoint.pop(FLAT_OPTIMIZER_STATES, [])):
            if len(per_rank) != self.world_size:
                raise ValueError(f"{path}: written by {len(per_rank)} ranks; the optimizer's sharded state "
                                 f"resumes only on the same number of ranks (this run has {self.world_size})")
            optimizer.load_state_dict(per_rank[self.global_rank])
        return checkpoint


