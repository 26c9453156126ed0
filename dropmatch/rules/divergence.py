"""Divergences between distributions over the vocabulary (natural log, nats). Pure tensor code."""

from __future__ import annotations

import math

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
    this is ~10x faster than float64 and agrees to ~1e-6 relative. The mixture's log is log(p + q) - ln 2,
    not log((p + q) / 2): halving the smallest subnormal rounds to 0, which made a token that one side
    gives ~1e-45 (logits ~100 nats below the top) an infinite term.
    """
    p, q = p.float(), q.float()
    log_m = (p + q).log() - math.log(2.0)
    return 0.5 * (_plogratio(p, p.log(), log_m).sum(dim=-1) + _plogratio(q, q.log(), log_m).sum(dim=-1))


def js_bounds(p_kept: torch.Tensor, q_kept: torch.Tensor, p_tail: torch.Tensor,
              q_tail: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds (lo, hi) on JS(p_i || q) for rows p_i of a distribution ``p`` against ``q`` over a
    vocabulary, from a subset of its tokens: ``p_kept`` (n, m) and ``q_kept`` (m,) are the probabilities
    on the subset, ``p_tail`` (n,) and ``q_tail`` the masses off it. (n,) float64 each.

    JS = sum_v [H-terms]: with m = (p + q) / 2, JS = sum_v (xlogy(p, p) + xlogy(q, q)) / 2 - xlogy(m, m), and a
    token's term lies in [0, ln 2 / 2 (p_v + q_v)]. So JS lies in [the sum over the subset, that + ln 2 / 2
    (p_tail + q_tail)]. The kept terms are summed in float64; the bounds carry no allowance for float32
    noise in the inputs.
    """
    pk, qk = p_kept.double(), q_kept.double()
    mk = 0.5 * (pk + qk)
    kept = (0.5 * xlogy(pk, pk) - xlogy(mk, mk)).sum(-1) + 0.5 * float(xlogy(qk, qk).sum())
    return kept, kept + 0.5 * math.log(2.0) * (p_tail.double() + q_tail)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy along the last axis."""
    return -xlogy(p.float(), p.float()).sum(dim=-1)
