"""IVON (ivon-opt) made seedable, shard-aware and Lightning-friendly (docs/architecture.md §5).

IVON — Shen et al. 2024, "Variational Learning is Effective for Large Deep Networks" (ICML), Alg. 1 — keeps a
diagonal Gaussian posterior q(θ) = N(m, σ²) over the weights, with mean m (the parameters themselves), a Hessian
estimate h, a gradient momentum g and

    σ = 1 / sqrt(λ · (h + δ))                         λ = ess (effective sample size), δ = weight_decay

One step of Alg. 1, as ivon-opt implements it (our subclass keeps this math; it reuses ivon-opt's
`_new_momentum`, `_new_hess`, `_new_param_averages`):

    sample   θ = m + σ⊙ε,  ε ~ N(0, I)                                      (`sampled_params`)
    record   ĝ = ∇ℓ(θ),  ĥ = ĝ·(θ − m)/σ² ("price"; "gradsq": ĥ = ĝ²)       (on exit with train=True,
                                                                            averaged over the MC samples)
    g ← β1·g + (1 − β1)·ĝ
    h ← β2·h + (1 − β2)·ĥ + ½(1 − β2)²·(h − ĥ)²/(h + δ)                    (keeps h positive)
    m ← m − α·clip((g/(1 − β1^t) + δ·m)/(h + δ), ±clip_radius),  α = lr·(h0 + δ) with rescale_lr

What this subclass adds (the math above is untouched; a test compares it with stock ivon-opt bit for bit):
* seeded noise: ε of each parameter comes from a `torch.Generator` seeded by `sample_seed(seed, current_step,
  sample_index, rank, param_index)`, so every sample is reproducible, also after a resume;
* fp32 state (h, g and the sample averages) whatever the parameter dtype; bf16 weights are read as fp32 and
  the result rounded back on write (so a step below the bf16 spacing is lost: `GRPOModule` asks for fp32 weights);
* parameters whose `.grad` is None count as a zero gradient (stock ivon-opt raises);
* the mean m is restored bit-exactly on leaving `sampled_params`, also when its body raises;
* parameters are written in place (storage kept: FSDP2 shards, shared rollout engines and in-flight
  autograd graphs stay valid), where ivon-opt rebinds `p.data`;
* `current_step` is part of `state_dict()`;
* `step()` needs no closure and accepts Lightning's manual-optimization closure that returns None;
* FSDP2 DTensor parameters are perturbed shard-locally: each rank draws the noise of its own shard (seeded by
  the shard's mesh coordinate) and h, g live per shard, so the gathered tensor is m + σ⊙ε.

ivon-opt (https://github.com/team-approx-bayes/ivon) is GPL-3.0-or-later; this module imports and subclasses it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import ivon
import torch
import torch.distributed as dist
from ivon._ivon import _welford_mean
from torch import Tensor

try:  # DTensor is public from torch 2.4; builds without distributed have none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # isinstance(x, ()) is always False

__all__ = ["IVON", "PosteriorSnapshot", "sample_seed", "bf16_spacing_warning"]


def sample_seed(seed: int, step: int, sample_index: int, rank: int, param_index: int) -> int:
    """Seed of the noise of one parameter (shard) in one weight sample: a 63-bit hash of the five integers.

    A cryptographic hash, not a sum, so that neighbouring (step, sample) pairs give unrelated streams."""
    data = struct.pack("<5q", seed, step, sample_index, rank, param_index)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & (2**63 - 1)


def _local(t: Tensor) -> Tensor:
    """The tensor this rank stores: the local shard of a DTensor (same storage), else `t` itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # in grad mode to_local() goes through autograd
            return t.to_local()
    return t


def _params(group: dict) -> list[Tensor]:
    return [p for p in group["params"] if p is not None]


def _cat(tensors: list[Tensor], device: torch.device) -> Tensor:
    return torch.cat(tensors, 0) if tensors else torch.zeros(0, device=device, dtype=torch.float32)


def _flat(shards: list[Tensor], device: torch.device) -> Tensor:
    """One flat copy of the shards (mixed dtypes promote to the widest, so writing it back is exact)."""
    with torch.no_grad():  # views of the parameters that autograd need not track
        return _cat([t.view(-1) if t.is_contiguous() else t.reshape(-1) for t in shards], device)


def _write_flat(shards: list[Tensor], flat: Tensor) -> None:
    """Copy consecutive slices of `flat` into the shards in place, one foreach call (rounds to each dtype)."""
    if shards:
        parts = flat.split([t.numel() for t in shards])
        torch._foreach_copy_(shards, [part.view(t.shape) for part, t in zip(parts, shards)])


def _draw_standard_normal(layout: list[tuple[int, int, torch.device]], device: torch.device) -> Tensor:
    """ε of one param group: flat fp32, one seeded draw per (local) param of `layout` ((numel, seed, device) each)
    written straight into its slice (the same numbers as drawing it alone: a contiguous fill of the same size)."""
    generators: dict[torch.device, torch.Generator] = {}
    flat = torch.empty(sum(n for n, _, _ in layout), device=device, dtype=torch.float32)
    offset = 0
    for numel, seed, where in layout:
        gen = generators.get(where)
        if gen is None:
            gen = generators[where] = torch.Generator(device=where)
        gen.manual_seed(seed)
        torch.randn(numel, generator=gen, out=flat[offset:offset + numel])
        offset += numel
    return flat


class PosteriorSnapshot:
    """IVON's posterior at one step, kept to draw its weight samples later, from any thread: per param group the
    mean m (a copy) and 1/σ, and the seeds of every sample. `sample(j)` is then what `IVON.sampled_stack([j])`
    gave at that step, bit for bit (the same draws and the same ops), at two copies of the (local) weights
    whatever the number of samples."""

    def __init__(self, optimizer: "IVON", num_samples: int):
        groups = [[_local(p) for p in _params(g)] for g in optimizer.param_groups]
        self._means = [_flat(shards, optimizer._device).float() for shards in groups]  # fp32 copies of m
        # 1/σ: IVON replaces this tensor when h changes, never writes it, so holding it is a snapshot
        self._scales = optimizer._noise_scales()
        self._layouts = [optimizer._noise_layout(j) for j in range(num_samples)]
        self._shapes = [[(t.shape, t.dtype) for t in shards] for shards in groups]
        self._device = optimizer._device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._means, *self._scales))

    def sample(self, j: int) -> list[Tensor]:
        """θ_j = m + σ⊙ε_j, one tensor per (local) parameter in param-group order and the parameter's dtype."""
        out = []
        for layout, mean, scale, shapes in zip(self._layouts[j], self._means, self._scales, self._shapes):
            row = torch.div(_draw_standard_normal(layout, self._device), scale)  # σ⊙ε_j, as in `_noises`
            row.add_(mean)  # + m
            for part, (shape, dtype) in zip(row.split([math.prod(shape) for shape, _ in shapes]), shapes):
                part = part.view(shape)
                out.append(part if part.dtype == dtype else part.to(dtype))
        return out


class IVON(ivon.IVON):
    """ivon-opt's IVON with seeded, shard-local sampling and fp32 state (see the module docstring).

    Arguments mirror `ivon.IVON` (`lr`, `ess` = λ, `hess_init` = h0, `beta1`, `beta2`, `weight_decay` = δ,
    `mc_samples`, `hess_approx`, `clip_radius`, `rescale_lr`; `sync`, `debias` through `**kwargs`), with the
    paper's LLM defaults. `seed` is the run seed; `rank` enters the seed of plain (non-DTensor) parameters, so
    data-parallel ranks draw different samples (pass the same rank everywhere for identical samples). A DTensor
    parameter uses its shard's mesh coordinate instead, so replicas of one shard (HSDP) draw the same noise.

    Gradient accumulation (as in ivon-opt): every `sampled_params(train=True)` context records, on exit, the
    `.grad` the parameters hold at that moment as one MC sample (running means of ĝ and of ε·σ⊙ĝ); `step()`
    uses the mean over all samples recorded since the last step, then clears them. So zero the gradients
    before each sample's backward and keep one context open over all micro-batches of one weight sample.
    `train=False` contexts record nothing.
    """

    def __init__(self, params: Iterable, lr: float, ess: float, hess_init: float = 1e-3, beta1: float = 0.9,
                 beta2: float = 0.9999, weight_decay: float = 1e-6, mc_samples: int = 1,
                 hess_approx: str = "price", clip_radius: float = float("inf"), rescale_lr: bool = True,
                 seed: int = 0, rank: int = 0, **kwargs: Any) -> None:
        if hess_approx not in self.hessian_approx_methods:
            raise ValueError(f"hess_approx={hess_approx!r}; valid: {', '.join(self.hessian_approx_methods)}")
        if int(rank) < 0:
            raise ValueError(f"rank={rank} must be >= 0")
        # Everything that changes after __init__ lives in this dict: Lightning's LightningOptimizer wrapper
        # forwards attribute reads to us but would keep attribute *writes* (e.g. current_step += 1) to itself.
        self._runtime: dict[str, Any] = {"current_step": 0, "sampling": False, "delta_sq": None, "delta_n": 1}
        self.seed, self.rank = int(seed), int(rank)
        super().__init__(params, lr=lr, ess=ess, hess_init=hess_init, beta1=beta1, beta2=beta2,
                         weight_decay=weight_decay, mc_samples=mc_samples, hess_approx=hess_approx,
                         clip_radius=clip_radius, rescale_lr=rescale_lr, **kwargs)
        if self.sync and any(isinstance(p, DTensor) for g in self.param_groups for p in _params(g)):
            # ivon-opt's sync all-reduces the flat sample averages: different shards would be summed together
            raise ValueError("sync=True averages samples across ranks; it is wrong for sharded (DTensor) "
                             "parameters, whose gradients FSDP already reduces. Use sync=False.")

    # ----------------------------------------------------------------------------------------------- state
    @property
    def current_step(self) -> int:
        """Number of `step()` calls so far (the t of the debiasing 1 − β1^t and of the noise seeds)."""
        return self._runtime["current_step"]

    @current_step.setter
    def current_step(self, value: int) -> None:
        self._runtime["current_step"] = int(value)

    def _get_param_configs(self) -> tuple[int, torch.device, torch.dtype]:
        """Like ivon-opt's, but counts local (shard) elements, allows mixed parameter dtypes and always
        returns fp32 — the dtype ivon-opt then uses for h and the momentum."""
        local = []
        for group in self.param_groups:
            shards = [_local(p) for p in _params(group)]
            group["numel"] = sum(t.numel() for t in shards)
            local += shards
        devices = {t.device for t in local}
        if len(devices) > 1:
            raise ValueError(f"IVON keeps flat per-group buffers; parameters are on several devices: "
                             f"{sorted(str(d) for d in devices)}")
        device = next(iter(devices)) if devices else torch.device("cpu")
        return sum(g["numel"] for g in self.param_groups), device, torch.float32

    def state_dict(self) -> dict[str, Any]:
        """ivon-opt's state (h and momentum per param group, pending sample averages) plus `current_step`."""
        state = super().state_dict()
        state["current_step"] = self.current_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        step = state_dict.pop("current_step", None)
        numels = [group["numel"] for group in self.param_groups]  # ours, from the params: the loader overwrites
        super().load_state_dict(state_dict)
        # torch restores group entries as saved: bring h and the momentum back to our device in fp32
        for i, (group, numel) in enumerate(zip(self.param_groups, numels)):
            group["numel"] = numel
            for key in ("momentum", "hess"):
                value = torch.as_tensor(group[key]).to(self._device, torch.float32)
                if value.numel() != numel:
                    raise ValueError(f"param group {i}: saved {key} has {value.numel()} elements, this optimizer "
                                     f"{numel} (different model or a different sharding/world size)")
                group[key] = value
        for key in ("avg_grad", "avg_nxg", "avg_gsq"):
            if self.state.get(key) is not None:
                self.state[key] = self.state[key].to(self._device, torch.float32)
        if step is not None:  # absent in a stock ivon-opt state dict: keep ours
            self.current_step = step

    # -------------------------------------------------------------------------------------------- sampling
    @contextmanager
    def sampled_params(self, sample_index: int = 0, train: bool = False) -> Iterator[None]:
        """Hold the parameters at θ = m + σ⊙ε (Alg. 1, sampling), ε seeded by
        (seed, current_step, sample_index, rank).

        train=True: on a normal exit record the parameters' current `.grad` as one MC sample of ĝ and of the
        Hessian estimate (ε·σ⊙ĝ for "price", ĝ² for "gradsq"), as stock `sampled_params(train=True)` does.
        On any exit, also an exception (then nothing is recorded), m is written back bit-exactly."""
        if self._runtime["sampling"]:
            raise RuntimeError("IVON.sampled_params is already active: nested samples would lose the mean")
        self._runtime["sampling"] = True
        try:
            param_avg, noise = self._sample_params(sample_index, keep_noise=train)
            finished = False
            try:
                yield
                finished = True
            finally:
                self._restore_param_average(train and finished, param_avg, noise)
        finally:
            self._runtime["sampling"] = False

    def _standard_normal(self, sample_index: int) -> list[Tensor]:
        """ε per param group: flat fp32 [group numel] (`_draw_standard_normal`)."""
        return [_draw_standard_normal(layout, self._device) for layout in self._noise_layout(sample_index)]

    def _noise_layout(self, sample_index: int) -> list[list[tuple[int, int, torch.device]]]:
        """Per param group, (numel, seed, device) of each (local) param's noise in sample `sample_index`."""
        layouts, param_index = [], 0
        for group in self.param_groups:
            layout = []
            for p in _params(group):
                local = _local(p)
                layout.append((local.numel(), sample_seed(self.seed, self.current_step, sample_index,
                                                          self._shard_key(p), param_index), local.device))
                param_index += 1
            layouts.append(layout)
        return layouts

    def _shard_key(self, p: Tensor) -> int:
        """`rank` for a plain tensor; for a DTensor the shard's coordinate over the mesh dims it is sharded on."""
        if not isinstance(p, DTensor):
            return self.rank
        coord = p.device_mesh.get_coordinate()
        if coord is None:  # this rank holds no part of p
            return 0
        key = 0
        for dim, placement in enumerate(p.placements):
            if placement.is_shard():
                key = key * p.device_mesh.size(dim) + coord[dim]
        return key

    def _noise_scales(self) -> list[Tensor]:
        """sqrt(λ(h+δ)) = 1/σ per param group, flat fp32 [group numel]; cached while h, λ and δ stay the same
        (h changes once per step, and a step samples 1 + N times)."""
        key = [(g["hess"], g["hess"]._version, g["ess"], g["weight_decay"]) for g in self.param_groups]
        cached = self._runtime.get("scales")
        same = cached is not None and len(cached[0]) == len(key) and all(
            a[0] is b[0] and a[1:] == b[1:] for a, b in zip(cached[0], key))  # h by identity and version
        if not same:
            cached = self._runtime["scales"] = (key, [(g["ess"] * (g["hess"] + g["weight_decay"])).sqrt()
                                                      for g in self.param_groups])
        return cached[1]

    def _noises(self, sample_index: int) -> list[Tensor]:
        """σ⊙ε per param group, flat fp32 [group numel], computed exactly as ivon-opt does (ε / sqrt(λ(h+δ))), so
        the bits match."""
        return [eps / scale for eps, scale in zip(self._standard_normal(sample_index), self._noise_scales())]

    @torch.no_grad()
    def _sample_params(self, sample_index: int = 0, keep_noise: bool = True) -> tuple[list[Tensor], list[Tensor]]:
        """Write θ = m + σ⊙ε into the parameters in place; return the saved means (one flat copy per group)
        and, if kept, σ⊙ε per group. Flat per-group ops, few passes over the weights: on a small model these
        vector ops, not the per-parameter bookkeeping, are the cost."""
        param_avg: list[Tensor] = []
        delta_sq = torch.zeros((), device=self._device, dtype=torch.float32)
        noises = self._noises(sample_index)
        try:
            for group, noise in zip(self.param_groups, noises):
                shards = [_local(p) for p in _params(group)]
                mean = _flat(shards, self._device)  # [group numel]: the copy that restores m bit-exactly
                param_avg.append(mean)
                theta = mean.float() + noise  # [group numel] fp32
                _write_flat(shards, theta)  # rounds to each param's dtype
                one_dtype = len({t.dtype for t in shards}) == 1
                written = theta.to(mean.dtype) if one_dtype else _flat(shards, self._device)  # θ as rounded
                delta = written.float() - mean.float()  # [group numel]
                delta_sq += torch.dot(delta, delta)
        except BaseException:
            self._write_means(param_avg)
            raise
        self._runtime["delta_sq"], self._runtime["delta_n"] = delta_sq, max(self._numel, 1)
        return param_avg, noises if keep_noise else []

    @torch.no_grad()
    def sampled_stack(self, sample_indices: Iterable[int]) -> list[Tensor]:
        """The samples θ_j = m + σ⊙ε_j, j in `sample_indices`, without touching the parameters: one [S, *shape]
        tensor per (local) parameter, in param-group order and the parameter's dtype, bit-equal to what
        `sampled_params(j)` writes. For running S weight samples in one batched forward (C3PO generation)."""
        indices = list(sample_indices)
        scales = self._noise_scales()
        stacks = [torch.empty((len(indices), g["numel"]), device=self._device)  # [S, group numel]
                  for g in self.param_groups]
        for row, j in enumerate(indices):
            for stack, eps, scale in zip(stacks, self._standard_normal(j), scales):
                torch.div(eps, scale, out=stack[row])  # σ⊙ε_j, as in `_noises`
        out = []
        for group, stack in zip(self.param_groups, stacks):
            shards = [_local(p) for p in _params(group)]
            stack.add_(_flat(shards, self._device).float())  # + m
            for part, local in zip(stack.split([t.numel() for t in shards], dim=1), shards):
                part = part.view(len(indices), *local.shape)  # a view into the stack
                out.append(part if part.dtype == local.dtype else part.to(local.dtype))
        return out

    @torch.no_grad()
    def _write_means(self, param_avg: list[Tensor]) -> None:
        for group, mean in zip(self.param_groups, param_avg):  # stops at the last saved group (partial sampling)
            _write_flat([_local(p) for p in _params(group)], mean)

    @torch.no_grad()
    def _restore_param_average(self, train: bool, param_avg: list[Tensor], noise: list[Tensor]) -> None:
        """Write m back first (so a failure below cannot leave θ in place), then record the MC sample."""
        self._write_means(param_avg)
        if not train:
            return
        grad_sample = self._grad_sample()  # [numel] fp32
        count = self.state["count"] + 1
        self.state["count"] = count
        self.state["avg_grad"] = _welford_mean(self.state["avg_grad"], grad_sample, count)
        if self.hess_approx == "price":
            self.state["avg_nxg"] = _welford_mean(self.state["avg_nxg"], _cat(noise, self._device) * grad_sample,
                                                  count)
        elif self.hess_approx == "gradsq":
            self.state["avg_gsq"] = _welford_mean(self.state["avg_gsq"], grad_sample.square(), count)

    def _grad_sample(self) -> Tensor:
        """Flat fp32 gradient of the local shards; a missing `.grad` counts as zero (as ivon-opt does for
        parameters that do not require grad)."""
        grads = []
        for group in self.param_groups:
            for p in _params(group):
                local = _local(p)
                if p.grad is None:
                    grads.append(torch.zeros(local.numel(), device=local.device, dtype=torch.float32))
                    continue
                grad = _local(p.grad)
                if grad.numel() != local.numel():
                    raise RuntimeError(f"gradient shard has {grad.numel()} elements, parameter shard "
                                       f"{local.numel()}: gradient and parameter must be sharded alike")
                grads.append(grad.reshape(-1))
        return _cat(grads, self._device).float()

    # ------------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Tensor]:
        """One IVON update from the MC samples recorded since the last step.

        A closure that returns a loss is called `mc_samples` times, each call expected to run its own
        `sampled_params(train=True)` (ivon-opt's protocol). A closure that returns None — Lightning's in manual
        optimization, which only runs its hooks — is called once; the samples must then have been recorded
        by the caller's own `sampled_params(train=True)` contexts."""
        if self._runtime["sampling"]:
            raise RuntimeError("IVON.step() inside sampled_params(): the update must start from the mean m")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is not None and self.mc_samples > 1:
                with torch.enable_grad():
                    losses = [loss] + [closure() for _ in range(self.mc_samples - 1)]
                loss = sum(losses) / self.mc_samples
        if self.state["count"] == 0:
            raise RuntimeError("IVON.step() without a recorded sample: run the forward/backward inside "
                               "`with optimizer.sampled_params(train=True):` before step()")
        if self.sync and dist.is_initialized():
            self._sync_samples()
        self._update()
        self._reset_samples()
        return loss

    def discard_samples(self) -> None:
        """Forget the MC samples recorded since the last step (a skipped step: a non-finite gradient must not
        enter the next step's average)."""
        self._reset_samples()

    def _update(self) -> None:
        """ivon-opt's `_update` (momentum, Hessian, mean: Alg. 1) on fp32 views of the local shards, written
        back in place and rounded to each parameter's dtype."""
        self.current_step += 1
        offset = 0
        for group in self.param_groups:
            b1, b2, wd = group["beta1"], group["beta2"], group["weight_decay"]
            pg_slice = slice(offset, offset + group["numel"])
            shards = [_local(p) for p in _params(group)]
            param_avg = _flat(shards, self._device).float()  # [group numel] fp32
            group["momentum"] = self._new_momentum(self.state["avg_grad"][pg_slice], group["momentum"], b1)
            group["hess"] = self._new_hess(self.hess_approx, group["hess"], self.state["avg_nxg"],
                                           self.state["avg_gsq"], pg_slice, group["ess"], b2, wd)
            lr = group["lr"] * (group["hess_init"] + wd) if self.rescale_lr else group["lr"]
            debias = 1.0 - math.pow(b1, float(self.current_step)) if self.debias else 1.0
            param_avg = self._new_param_averages(param_avg, group["hess"], group["momentum"], lr, wd,
                                                 group["clip_radius"], debias, group["hess_init"])
            _write_flat(shards, param_avg)
            offset += group["numel"]

    # ------------------------------------------------------------------------------------------ inspection
    @torch.no_grad()
    def sigma(self) -> list[Tensor]:
        """σ = 1/sqrt(λ(h + δ)) per parameter, fp32, shaped like the parameter's local shard."""
        out = []
        for group in self.param_groups:
            sig = 1.0 / (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()  # [group numel]
            offset = 0
            for p in _params(group):
                local = _local(p)
                out.append(sig[offset:offset + local.numel()].view(local.shape))
                offset += local.numel()
        return out

    @torch.no_grad()
    def noise_stats(self) -> dict[str, Tensor]:
        """Detached scalar tensors (no device sync): mean σ over all (local) elements, and the RMS of the
        perturbation θ − m of the last sample as actually written (after rounding to the param dtype; 0
        before any sample), that RMS over the RMS of the weights m (`noise/relative`), and how many weights the
        posterior covers (`noise/numel`: the adapters alone with LoRA). Under FSDP these are this rank's shards only."""
        total = torch.zeros((), device=self._device, dtype=torch.float32)
        for group in self.param_groups:
            total += (1.0 / (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()).sum()
        delta_sq = self._runtime["delta_sq"]
        if delta_sq is None:
            delta_sq = torch.zeros((), device=self._device, dtype=torch.float32)
        mean_sq = torch.zeros((), device=self._device, dtype=torch.float32)
        for group in self.param_groups:
            for p in _params(group):
                mean_sq += _local(p).float().square().sum()
        delta_rms = (delta_sq / self._runtime["delta_n"]).sqrt()
        param_rms = (mean_sq / max(self._numel, 1)).sqrt()
        return {"noise/sigma_mean": total / max(self._numel, 1),
                "noise/param_delta_rms": delta_rms,
                "noise/relative": delta_rms / param_rms.clamp_min(1e-30),  # the noise's size against the weights'
                "noise/numel": torch.tensor(float(self._numel))}


def bf16_spacing_warning(optimizer: IVON, reference_params: Iterable[Tensor]) -> Optional[str]:
    """A warning message when the mean σ of `optimizer` is below the bf16 spacing of the typical weight
    magnitude (mean |w| of `reference_params`), else None. A bf16 rollout engine rounds such perturbations
    away, so the "sampled" policies would all equal the mean (docs/architecture.md §5). Not for hot paths: it syncs."""
    abs_sum, count = 0.0, 0
    for p in reference_params:
        local = _local(p).detach()
        abs_sum += float(local.float().abs().sum())
        count += local.numel()
    if count == 0 or abs_sum == 0.0:
        return None
    typical = abs_sum / count
    # bf16 has 8 significand bits: neighbouring values near x are eps·2^⌊log2 x⌋ apart, eps = 2^-7
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(typical))
    sigma_mean = float(optimizer.noise_stats()["noise/sigma_mean"])
    if sigma_mean >= spacing:
        return None
    return (f"IVON sigma mean {sigma_mean:.3g} is below the bf16 spacing {spacing:.3g} of typical weights "
            f"(mean |w| = {typical:.3g}): a bf16 rollout engine rounds most perturbations away and every weight "
            f"sample generates like the mean. Lower ess (lambda) or hess_init, or run the engine in fp32.")
