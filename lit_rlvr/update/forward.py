"""The update's forward: the policy's log-probs of a batch's response tokens at the sampling temperature."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from lit_rlvr import functional as F
from lit_rlvr.rollout.batch import Rollouts


def forward_logprobs(model: nn.Module, rollouts: Rollouts, *, temperature: float,
                     device: Optional[Union[str, torch.device]] = None) -> tuple[Tensor, Tensor]:
    """Log-probs [n, T] of the response tokens at `temperature` (the distribution the engine sampled from), and the
    logits [n, T, V], computed on `device` (None: where the batch is). Every token of the sequence is attended to,
    observations included (`response_attention_mask`); the loss masks them."""
    device = device if device is not None else rollouts.prompt_ids.device
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1).to(device)  # [n, P+T]
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_attention_mask], dim=1).to(device)  # [n, P+T]
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)  # [n, P+T] left padding starts at 0
    width = rollouts.response_ids.shape[1]
    # one position more than the response: the logits at t score token t + 1; the last one is dropped
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                   logits_to_keep=width + 1).logits[:, :-1]  # [n, T, V]
    return F.token_logprobs(logits, rollouts.response_ids.to(device), temperature=temperature), logits
