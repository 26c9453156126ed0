"""Divergences between distributions over the vocabulary (natural log, nats). Pure tensor code."""

from __future__ import annotations

import torch
from torch.special import xlogy


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) along the last axis; ``inf`` where p puts mass q does not."""
    p, q = p.double(), q.double()
    terms = xlogy(p, p) - xlogy(p, q)
    return terms.sum(dim=-1).float()


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence along the last axis, in [0, ln 2]. Broadcasts leading axes."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)
    terms = 0.5 * (xlogy(p, p) - xlogy(p, m)) + 0.5 * (xlogy(q, q) - xlogy(q, m))
    return terms.sum(dim=-1).float()


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy along the last axis."""
    return -xlogy(p.double(), p.double()).sum(dim=-1).float()
