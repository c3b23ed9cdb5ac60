"""`algorithm.rollout_correction`: verl's options for the training-inference mismatch, checked once.

`GRPOModule`'s constructor builds a `RolloutCorrection` from its `rollout_correction` argument (a dict with verl's
key names), so `train.py`, the Lightning CLI and Python share the checks and the defaults. It computes nothing:
the math is in `lit_rlvr.functional.rollout_correction`; what one update runs of it (the IS weights, the
rejection mask), `lit_rlvr.update.correction`;
docs/rollout_correction.md is the user guide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from lit_rlvr.config.problems import checked_fields
from lit_rlvr.functional import rollout_correction as RC

KEY = "algorithm.rollout_correction"
# verl keys that a verl config carries at these values; lit-rlvr does exactly that, so they are accepted as is
VERL_FIXED = {"loss_type": "ppo_clip", "rollout_is_batch_normalize": False}
Threshold = Union[float, str]  # the fields are annotated Any: Hydra's schemas take no Union (checked here instead)


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's `algorithm.rollout_correction` (names and meanings of verl 0.9.1; docs/rollout_correction.md).

    rollout_is: None | "token" | "sequence" — truncated importance weights π_old/π_engine on the loss terms.
    rollout_is_threshold: C (weights capped at C, TIS) or "a_b" (weights outside [a, b] zeroed, IcePop).
    rollout_rs: None | rejection options, comma-separated: "token", "sequence", "geometric" or verl's
        "token_k1" … "seq_max_k3" (`functional.rollout_correction.rejection_mask`).
    rollout_rs_threshold: the rejection bounds as verl parses them; None = rollout_is_threshold (verl 0.6's
        rule; verl ≥ 0.7 requires it), so `rollout_rs=sequence` alone keeps sequence ratios in [1/2, 2].
    bypass_mode: True — the engine's log-probs are π_old (no extra forward); the rejection mask is taken from the
        current log-probs in every loss pass, and IS weights are refused (verl computes and ignores them with a
        PPO-clip loss: the PPO ratio already is π_θ/π_engine). False — one extra no-grad forward per update gives
        π_old, as verl's actor recomputes it; the IS weights and rejection come from π_old/π_engine, before the
        update. None (default) — False when a correction is on (verl's default), True when none is (today's
        loss, no extra forward).
    """

    rollout_is: Optional[str] = None
    rollout_is_threshold: Any = 2.0  # a Threshold
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Any = None  # an Optional[Threshold]
    bypass_mode: Optional[bool] = None

    @classmethod
    def from_options(cls, options: Union[None, Mapping[str, Any], "RolloutCorrection"]) -> "RolloutCorrection":
        """From a mapping of verl's keys (None = all defaults); unknown keys fail, naming them."""
        if isinstance(options, cls):
            return options
        options = checked_fields(cls, options, KEY, also=VERL_FIXED)
        for key, fixed in VERL_FIXED.items():
            value = options.pop(key, fixed)
            if value != fixed:
                raise ValueError(f"{KEY}.{key}={value!r}: lit-rlvr's loss is PPO-clip with raw weights (verl's "
                                 f"{key}={fixed!r}); remove the key, or subclass GRPOModule.policy_loss")
        return cls(**options)

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in RC.IS_LEVELS:
            raise ValueError(f"{KEY}.rollout_is={self.rollout_is!r}; valid: null, {', '.join(RC.IS_LEVELS)}")
        try:
            RC.is_threshold_bounds(self.rollout_is_threshold)
        except ValueError as err:
            raise ValueError(f"{KEY}.rollout_is_threshold={self.rollout_is_threshold!r}: {err}; use a number C > 0 "
                             "(truncate at C) or a quoted 'lower_upper' string (zero outside)") from None
        if self.rollout_rs is not None:
            try:
                RC.rs_options(self.rollout_rs)
            except ValueError as err:
                raise ValueError(f"{KEY}.rollout_rs={self.rollout_rs!r}: {err}; null turns it off") from None
            try:
                RC.rs_threshold_bounds(self.rollout_rs, self.rs_threshold)
            except ValueError as err:
                inherited = " (null: rollout_is_threshold's)" if self.rollout_rs_threshold is None else ""
                raise ValueError(f"{KEY}.rollout_rs_threshold={self.rs_threshold!r}{inherited} for rollout_rs="
                                 f"{self.rollout_rs!r}: {err}") from None
        problem = self._on_policy_problem()
        if problem:
            raise ValueError(problem)
        if self.bypass_mode not in (None, True, False):
            raise ValueError(f"{KEY}.bypass_mode={self.bypass_mode!r}; valid: true, false, null (false when a "
                             "correction is on)")
        if self.bypass_mode is True and self.rollout_is is not None:
            raise ValueError(f"{KEY}.rollout_is={self.rollout_is!r} needs bypass_mode=false: in bypass mode the PPO "
                             f"ratio π_θ/π_engine already is the importance weight (verl computes it and ignores "
                             f"it); set {KEY}.bypass_mode=false (or null), or rollout_is=null")

    def _on_policy_problem(self) -> Optional[str]:
        """A bound that is not finite, or whose accepted interval excludes the on-policy value (ratio 1; k2 and k3
        statistics 0, which any bound > 0 accepts): with an engine that computes the trainer's log-probs exactly
        it would zero every token's term (loss 0, gradient 0 at every step). None when the bounds are fine."""
        upper, lower = RC.is_threshold_bounds(self.rollout_is_threshold)
        if not all(math.isfinite(b) for b in (upper, 1.0 if lower is None else lower)):
            return (f"{KEY}.rollout_is_threshold={self.rollout_is_threshold!r} is not finite: expected a finite number "
                    "C >= 1 (weights capped at C) or a quoted 'lower_upper' string with lower <= 1 <= upper")
        if self.rollout_is is not None and (upper < 1 or (lower or 0.0) > 1):
            effect = "caps every weight below 1" if lower is None else "zeroes the weight 1"
            return (f"{KEY}.rollout_is_threshold={self.rollout_is_threshold!r} {effect}, the on-policy weight (of an "
                    "engine that computes the trainer's log-probs): expected a number C >= 1 (weights capped at C) "
                    "or a quoted 'lower_upper' string with lower <= 1 <= upper")
        if self.rollout_rs is None:
            return None
        for option, lower, upper in RC.rs_threshold_bounds(self.rollout_rs, self.rs_threshold):
            finite = all(math.isfinite(b) for b in (upper, 1.0 if lower is None else lower))
            if finite and (lower is None or lower <= 1 <= upper):
                continue
            inherited = " (null: rollout_is_threshold's)" if self.rollout_rs_threshold is None else ""
            accepted = ("a finite bound > 0" if lower is None else "a finite number C >= 1 (keeps ratios in [1/C, C]) "
                        "or a quoted 'lower_upper' string with lower <= 1 <= upper")
            return (f"{KEY}.rollout_rs_threshold={self.rs_threshold!r}{inherited} for rollout_rs={self.rollout_rs!r}: "
                    f"{option} keeps ratios in [{lower:g}, {upper:g}], which excludes 1, the on-policy ratio: every "
                    f"token would be masked (loss 0) with an engine that computes the trainer's log-probs; expected "
                    f"{accepted}" if finite else
                    f"{KEY}.rollout_rs_threshold={self.rs_threshold!r}{inherited} for rollout_rs={self.rollout_rs!r}: "
                    f"{option}'s bound is not finite; expected {accepted}")
        return None

    # -- what the module asks ----------------------------------------------------------------------------------
    @property
    def corrects(self) -> bool:
        """Whether the loss is changed at all (IS weights or rejection)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def bypass(self) -> bool:
        """The resolved `bypass_mode`."""
        return (not self.corrects) if self.bypass_mode is None else self.bypass_mode

    @property
    def rs_threshold(self) -> Threshold:
        return self.rollout_is_threshold if self.rollout_rs_threshold is None else self.rollout_rs_threshold

    def masking_settings(self) -> list[str]:
        """The options set that can zero a token's term ("key=value"), for the module's all-masked stop."""
        out = []
        if self.rollout_is is not None and "_" in str(self.rollout_is_threshold):  # IcePop zeroes; TIS only caps
            out.append(f"{KEY}.rollout_is={self.rollout_is!r} rollout_is_threshold={self.rollout_is_threshold!r}")
        if self.rollout_rs is not None:
            out.append(f"{KEY}.rollout_rs={self.rollout_rs!r} rollout_rs_threshold={self.rs_threshold!r}")
        return out

    def check_loss_class(self, module_class: type, base: type) -> None:
        """A correction weights each token's loss term: the class that defines `policy_loss` must be `base`
        (GRPOModule, whose loss applies `rollouts.token_weights`) or say it applies them too, with a class attribute
        `policy_loss_applies_token_weights = True`."""
        owner = next(c for c in module_class.__mro__ if "policy_loss" in vars(c))
        if self.corrects and owner is not base and not vars(owner).get("policy_loss_applies_token_weights", False):
            raise ValueError(f"{KEY}: rollout_is / rollout_rs weight each token's loss term, but {owner.__name__}."
                             "policy_loss does not apply rollouts.token_weights; set both to null (the mismatch/* "
                             "metrics are logged anyway)")
