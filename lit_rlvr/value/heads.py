"""V0 heads: predict the policy's success probability p̂ of a prompt from its features, in context
(docs/architecture.md §6).

A head is fit on the context set (M records: features, success rate, rollout count) and predicts B new
prompts in one pass, without gradients. Both heads share the API:
`fit(features [M, F], success_rate [M], counts [M]) -> self` and `predict(features [B, F]) -> p̂ [B]`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lit_rlvr.config.extras import require

DEFAULT_BANDWIDTH_SCALES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 4.0)


class KernelHead:
    """Closed-form Beta–Binomial kernel smoother (our default head where TabPFN weights are not available):

        p̂(x) = (α0·p̄ + Σ_j k(x, x_j)·n_j·y_j) / (α0 + Σ_j k(x, x_j)·n_j)

    with y_j the success rate and n_j the rollout count of context record j, p̄ the pooled context success
    rate (the Beta prior's mean, α0 its strength in pseudo-rollouts) and k an RBF kernel
    exp(−‖x − x'‖² / (2h²)) on features standardized with the context's mean and std. The bandwidth h is
    `scale × median pairwise context distance`, the scale picked from `bandwidth_scales` by the leave-one-out
    Binomial log-likelihood of the context (ties go to the largest scale: the smoother fit).

    The geometry — the standardization (context mean and std) and the bandwidth h, which is chosen for that
    metric — comes from a search. `fit(..., search=False)` keeps the last search's geometry and skips its M×M
    work, fitting only the given records; with the same context, both give the same p̂ (see ValueModel's
    `bandwidth_refit`). In the geometry a record's standardized row and its squared norm depend on that record
    alone (`standardize`), so a caller whose context changes by a few records per step can keep the rows of
    the records that stay and pass them to `fit_standardized` (see ValueModel): `fit(search=False)`'s bits.
    """

    SEARCH_FLOATS = 1 << 26  # most kernel weights the bandwidth search holds at once (256 MB of float32)

    def __init__(self, alpha0: float = 2.0, bandwidth_scales: Sequence[float] = DEFAULT_BANDWIDTH_SCALES) -> None:
        if alpha0 <= 0 or not bandwidth_scales or min(bandwidth_scales) <= 0:
            raise ValueError(
                f"KernelHead needs alpha0 > 0 and positive bandwidth_scales, got {alpha0}, {bandwidth_scales}"
            )
        self.alpha0 = alpha0
        self.bandwidth_scales = tuple(float(s) for s in bandwidth_scales)
        self.fitted = False
        self.bandwidth_: Optional[Tensor] = None
        self.geometry_id = 0  # changes whenever the standardization does: rows standardized before are stale

    def fit(self, features: Tensor, success_rate: Tensor, counts: Tensor, search: bool = True) -> "KernelHead":
        """Fit on M records (features [M, F]); `search` = new geometry from them (always when there is none)."""
        x = features.detach().double()  # [M, F] float64: exp(-d²) of near points must not underflow unevenly
        search = search or self.bandwidth_ is None
        if search:
            self._set_standardization(x)
        z, sq_norm = self.standardize(x)  # [M, F], [M]
        self.fit_standardized(z.T.contiguous(), sq_norm, success_rate, counts)
        if search:
            self._search_bandwidth(z)
        return self

    def _set_standardization(self, x: Tensor) -> None:
        """mean_ [F] and std_ [F] (two-pass, float64) of the context x [M, F]."""
        self.mean_ = x.mean(0)  # [F]
        centered = x - self.mean_  # [M, F]
        std = (centered * centered).sum(0).sqrt() / len(x) ** 0.5  # [F]
        self.std_ = std.clamp_min(1e-6)  # [F]
        self.geometry_id += 1

    def standardize(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Standardized rows z = (x − mean) / std [N, F] float64 and their squared norms ‖z‖² [N], in the current
        geometry. Row-wise: a row's values do not depend on the other rows it comes with."""
        z = (features.detach().double() - self.mean_) / self.std_  # [N, F]
        return z, (z * z).sum(1)  # [N, F], [N]

    def fit_standardized(self, zt: Tensor, sq_norm: Tensor, success_rate: Tensor, counts: Tensor) -> "KernelHead":
        """Fit on M records given by `standardize` in the current geometry: their rows as columns zt [F, M] (any
        strides: a view of a caller's buffer does; the layout predict's matmul reads fastest) and norms [M]."""
        if self.geometry_id == 0:
            raise RuntimeError("KernelHead.fit_standardized needs a geometry: call fit(..., search=True) first")
        self.zt_, self.sq_norm_ = zt, sq_norm  # [F, M], [M]
        self.y_ = success_rate.detach().double().clamp(0, 1)  # [M]
        self.n_ = counts.detach().double().clamp_min(0)  # [M]
        self.tallies_ = torch.stack([self.n_ * self.y_, self.n_], 1)  # [M, 2] successes, rollouts
        successes, rollouts = self.tallies_.sum(0).tolist()
        self.p_bar_ = (successes + 0.5) / (rollouts + 1.0)  # pooled rate, Jeffreys-smoothed
        # the Beta prior as one more row of tallies, (α0·p̄, α0), with kernel weight 1 (see _smooth)
        self.prior_tally_ = torch.tensor([self.alpha0 * self.p_bar_, self.alpha0], dtype=torch.float64)  # [2]
        self.fitted = True
        return self

    def _search_bandwidth(self, z: Tensor) -> None:
        """h = scale × median pairwise distance of the standardized context z [M, F], the scale of best
        leave-one-out likelihood (ties: the largest).

        In float32 and for all scales at once: the search only ranks a dozen bandwidths, and its M×M work was most
        of the prior's cost (at M = 256 and 384 features, one thread: 11 ms in float64 one scale at a time, ~4.5
        ms this way). Kernel weights below e^-80 are noise next to the Beta prior's α0 pseudo-rollouts."""
        m = len(z)
        x = z.float()  # [M, F]
        sq_norm = (x * x).sum(1)  # [M]
        d2 = torch.addmm(sq_norm[:, None] + sq_norm[None, :], x, x.T, alpha=-2).clamp_min_(0)  # [M, M] distance²
        pairs = d2[torch.triu_indices(m, m, 1).unbind()]  # [M(M−1)/2] each pair once
        median = pairs.median().sqrt() if m > 1 else torch.ones(())  # sqrt is monotone: the median distance
        grid = torch.tensor(self.bandwidth_scales) * median.clamp_min(1e-6)  # [S]
        # scales a few at a time where S kernels of M×M would not fit in SEARCH_FLOATS (0.8 GB at M = 4096)
        per_batch = max(1, self.SEARCH_FLOATS // (m * m))
        p = torch.cat([self._loo_smooth(d2, scales) for scales in (-0.5 / grid.square()).split(per_batch)])
        p = p.double().clamp(1e-6, 1 - 1e-6)  # [S, M]
        self.loo_loglik_ = (self.n_ * (self.y_ * p.log() + (1 - self.y_) * (1 - p).log())).sum(1)  # [S]
        self.bandwidth_grid_ = grid.double()  # [S]
        last_best = len(grid) - 1 - self.loo_loglik_.flip(0).argmax()  # [] ties → the largest bandwidth
        self.bandwidth_ = self.bandwidth_grid_[last_best]  # []

    def _loo_smooth(self, d2: Tensor, scales: Tensor) -> Tensor:
        """Leave-one-out p̂ [s, M] of every context record for kernels exp(scale·d²), scales [s] = −1/(2h²)."""
        # the exponent floored at −80: float32 exp is ~30× slower where it underflows
        k = torch.exp((d2 * scales[:, None, None]).clamp_min_(-80.0))  # [s, M, M]
        k.diagonal(dim1=1, dim2=2).zero_()  # record i never predicts itself
        return self._smooth(k)

    def geometry(self) -> dict[str, Tensor]:
        """What `fit(search=False)` keeps from the last search (a checkpoint carries it: exact resume)."""
        return {"bandwidth": self.bandwidth_, "mean": self.mean_, "std": self.std_}

    def load_geometry(self, state: dict[str, Tensor]) -> bool:
        """Restore a search's geometry; False (nothing restored: the next fit searches) for a state without
        the standardization (checkpoints written before it was part of the geometry)."""
        if "mean" not in state or "std" not in state:
            return False
        self.bandwidth_, self.mean_, self.std_ = state["bandwidth"], state["mean"], state["std"]
        self.geometry_id += 1
        return True

    def _smooth(self, k: Tensor) -> Tensor:
        """p̂ for rows of kernel weights k [B, M] (or [S, B, M]: S kernels at once) over the context, in k's dtype:
        (α0·p̄ + Σ_j k_j·n_j·y_j) / (α0 + Σ_j k_j·n_j), [B] (or [S, B])."""
        prior, tallies = self.prior_tally_.to(k.dtype), self.tallies_.to(k.dtype)  # [2], [M, 2]
        if k.dim() == 2:
            smoothed = torch.addmm(prior, k, tallies)  # [B, 2] prior + kernel-weighted tallies
        else:
            smoothed = torch.baddbmm(prior.expand(1, 1, 2), k, tallies.expand(len(k), *tallies.shape))  # [S, B, 2]
        return smoothed[..., 0] / smoothed[..., 1]

    def predict(self, features: Tensor) -> Tensor:
        """p̂ [B] of features [B, F] (float32 unless the features are another float type)."""
        p_hat = self.predict_standardized(*self.standardize(features))  # [B] float64
        return p_hat.to(features.dtype if features.is_floating_point() else torch.float32)

    def predict_standardized(self, z: Tensor, sq_norm: Tensor) -> Tensor:
        """p̂ [B] float64 of `standardize`'s rows z [B, F] and norms [B] (the current geometry's)."""
        if not self.fitted:
            raise RuntimeError("KernelHead.predict called before fit")
        # ‖z − z_j‖² = ‖z‖² − (2 z·z_j − ‖z_j‖²): one matmul over the context's rows (B is small: torch.cdist's
        # set-up costs more)
        cross = torch.addmm(self.sq_norm_, z, self.zt_, beta=-1, alpha=2)  # [B, M] 2 z·z_j − ‖z_j‖²
        d2 = (sq_norm.unsqueeze(1) - cross).clamp_min_(0)  # [B, M]
        k = torch.exp(d2 * (-0.5 / float(self.bandwidth_) ** 2))  # [B, M] exp(−d² / (2h²))
        return self._smooth(k)  # [B]


class TabPFNHead:
    """TabPFN classifier head (paper: TabPFN v2.5, 4 estimators): context labels are success rate ≥
    `threshold`, the output is P(class 1).

    `model_path`: a local TabPFN checkpoint (.ckpt / .safetensors). None = TabPFN v2.5's default classifier
    from tabpfn's cache dir; tabpfn downloads it when missing (a gated model: it may ask to accept its
    license), which is only attempted when HF_HUB_OFFLINE is unset. When the context holds a single
    class TabPFN cannot fit; the head then predicts the context's Jeffreys-smoothed success rate.
    """

    def __init__(
        self,
        model_path: Optional[str | Path] = None,
        n_estimators: int = 4,
        threshold: float = 0.5,
        device: str = "cpu",
        random_state: int = 0,
        **tabpfn_kwargs: Any,
    ) -> None:
        self.model_path = _resolve_tabpfn_path(model_path)
        self.n_estimators = n_estimators
        self.threshold = threshold
        self.device = device
        self.random_state = random_state
        self.tabpfn_kwargs = {"ignore_pretraining_limits": True, **tabpfn_kwargs}  # 1008 features > 500
        self.fitted = False

    def fit(self, features: Tensor, success_rate: Tensor, counts: Tensor) -> "TabPFNHead":
        TabPFNClassifier = require("tabpfn").TabPFNClassifier

        labels = (success_rate.detach() >= self.threshold).long().cpu().numpy()  # [M]
        n = counts.detach().double().clamp_min(0)  # [M]
        self.constant_ = float(((n * success_rate.detach().double()).sum() + 0.5) / (n.sum() + 1.0))
        self.single_class_ = len(set(labels.tolist())) < 2
        if not self.single_class_:
            self.clf_ = TabPFNClassifier(
                model_path=self.model_path,
                n_estimators=self.n_estimators,
                device=self.device,
                random_state=self.random_state,
                **self.tabpfn_kwargs,
            )
            self.clf_.fit(features.detach().float().cpu().numpy(), labels)
        self.fitted = True
        return self

    def predict(self, features: Tensor) -> Tensor:
        if not self.fitted:
            raise RuntimeError("TabPFNHead.predict called before fit")
        if self.single_class_:
            return torch.full((features.shape[0],), self.constant_, dtype=torch.float32)  # [B]
        proba = self.clf_.predict_proba(features.detach().float().cpu().numpy())  # [B, classes]
        column = list(self.clf_.classes_).index(1)
        return torch.as_tensor(proba[:, column], dtype=torch.float32)  # [B]


def _resolve_tabpfn_path(model_path: Optional[str | Path]) -> str:
    """A local checkpoint as given; None = the paper's TabPFN v2.5 classifier in tabpfn's cache dir, which
    tabpfn downloads on first use, so that is refused up front when the hub is off (HF_HUB_OFFLINE)."""
    if model_path is not None:
        path = Path(model_path)
        if not path.exists():
            raise FileNotFoundError(f"TabPFN checkpoint not found: {path} (set the value head's model_path)")
        return str(path)

    require("tabpfn")
    from tabpfn.model_loading import ModelSource, prepend_cache_path

    default = prepend_cache_path(ModelSource.get_classifier_v2_5().default_filename)
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false")
    if offline and not Path(default).exists():
        raise RuntimeError(
            f"TabPFNHead: no model_path given, {default} is not downloaded and HF_HUB_OFFLINE is set; "
            "pass model_path=<local TabPFN checkpoint> or use the kernel head"
        )
    return default
