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
    this is ~10x faster than float64 and agrees to ~1e-6 relative.
    """
    p, q = p.float(), q.float()
    log_m = (0.5 * (p + q)).log()
    return 0.5 * (_plogratio(p, p.log(), log_m).sum(dim=-1) + _plogratio(q, q.log(), log_m).sum(dim=-1))


def js_bounds(p: torch.Tensor, q: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds (lo, hi) on JS(p_i || q) for each row p_i of ``p`` (n, V) against ``q`` (V,), from the
    tokens of ``keep`` (V,) bool alone: (n,) float64 each.

    JS = sum_v [H-terms]: with m = (p + q) / 2, JS = sum_v (xlogy(p, p) + xlogy(q, q)) / 2 - xlogy(m, m), and a
    token's term lies in [0, ln 2 / 2 (p_v + q_v)]. So JS lies in [the sum over ``keep``, that + ln 2 / 2
    (mass of p_i and q off ``keep``)]. The kept terms are summed in float64; the bounds carry no allowance
    for float32 noise in p, q.
    """
    p, q = p.float(), q.float()
    tokens = keep.nonzero().squeeze(-1)
    pk, qk = p.index_select(-1, tokens).double(), q.index_select(-1, tokens).double()
    q_term = 0.5 * float(xlogy(qk, qk).sum())
    mk = 0.5 * (pk + qk)
    kept = (0.5 * xlogy(pk, pk) - xlogy(mk, mk)).sum(-1) + q_term
    off = (~keep).to(p.dtype)
    tail = torch.mv(p, off).double() + float(torch.dot(q, off))
    return kept, kept + 0.5 * math.log(2.0) * tail


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy along the last axis."""
    return -xlogy(p.float(), p.float()).sum(dim=-1)
