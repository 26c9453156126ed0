"""Criteria combined: accept when any member accepts ("Auto-Judge + DM")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..sampling import SamplingConfig
from .base import Criterion, PositionTest, Prefetch, Prefetching, VerifyInput, screened_logits_ok


class AnyOf:
    """Accept when any of the criteria accepts ("Auto-Judge + DM"). A member's prefetch (DropMatch's
    fused heads) is passed through."""

    def __init__(self, criteria: Sequence[Criterion]):
        self.criteria = list(criteria)
        self.name = "+".join(c.name for c in self.criteria)

    @property
    def screened_logits_ok(self) -> bool:
        return all(screened_logits_ok(c) for c in self.criteria)

    def prefetch(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Prefetch | None:
        for i, c in enumerate(self.criteria):
            if isinstance(c, Prefetching):
                inner = c.prefetch(hidden, sampling, generator)
                return Prefetch(inner.rows, (i, inner))
        return None

    def prepare(self, inp: VerifyInput) -> PositionTest:
        owner, inner = inp.prefetch.state if inp.prefetch is not None else (None, None)
        if inner is not None:
            inner.products = inp.prefetch.products
        tests = [c.prepare(replace(inp, prefetch=inner if i == owner else None)) for i, c in enumerate(self.criteria)]
        return lambda j: any(t(j) for t in tests)
