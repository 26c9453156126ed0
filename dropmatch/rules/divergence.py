"""Divergences between distributions over the vocabulary (natural log, nats). Pure tensor code."""

from __future__ import annotations

import torch
from torch.special import xlogy


def _plogratio(p: torch.Tensor, log_p: torch.Tensor, log_m: torch.Tensor) -> torch.Tensor:
    """p * (log p - log m), with 0 where p = 0 (where m may be 0 too)."""
    return torch.where(p > 0, p * (log_p - log_m), torch.zeros((), dtype=p.dtype, device=p.device))


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) along the last axis; ``inf`` where p puts mass q does not."""
    p, q = p.float(), q.float()
    return _plogratio(p, p.log(), q.log()).sum(dim=-1)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence along the last axis, in [0, ln 2]. Broadcasts leading axes.

    float32 throughout (one log per distribution and one for the mixture): over a 262k vocabulary
    this is ~10x faster than float64 and agrees to ~1e-6 relative.
    """
    p, q = p.float(), q.float()
    log_m = (0.5 * (p + q)).log()
    return 0.5 * (_plogratio(p, p.log(), log_m).sum(dim=-1) + _plogratio(q, q.log(), log_m).sum(dim=-1))


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy along the last axis."""
    return -xlogy(p.float(), p.float()).sum(dim=-1)
