"""Prompt lookup (n-gram) drafting: no model, no distributions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..errors import ConfigError
from ..sampling import SamplingConfig
from .base import Draft


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n-gram
    (n from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it; with
    ``earliest``, the first occurrence instead (vLLM's n-gram proposer).
    No model and no distributions (verification treats the draft as one-hot)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, earliest: bool = False):
        check_ngram_sizes(min_ngram, max_ngram)
        self.max_ngram, self.min_ngram, self.earliest = max_ngram, min_ngram, earliest
        self.context: list[int] = []
        self._proposed: list[int] = []
        self.device = torch.device("cpu")

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.context = prompt_ids.tolist()
        self.device = prompt_ids.device
        self._proposed = []

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        self.context.append(last_token)
        tokens = lookup(self.context, n, self.max_ngram, self.min_ngram, self.earliest)
        self._proposed = tokens
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device))

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        self.context.extend(self._proposed[:n_accepted])


def check_ngram_sizes(min_ngram: int, max_ngram: int) -> None:
    """Refuse n-gram sizes outside 1 <= ``min_ngram`` <= ``max_ngram``."""
    if not 1 <= min_ngram <= max_ngram:
        raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def lookup(context: Sequence[int], n: int, max_ngram: int, min_ngram: int = 1, earliest: bool = False) -> list[int]:
    """Tokens following the most recent (``earliest``: the first) earlier match of the longest matching
    suffix n-gram; up to ``n`` of them."""
    return next(lookup_candidates(context, n, max_ngram, min_ngram, earliest), [])


def lookup_candidates(context: Sequence[int], n: int, max_ngram: int, min_ngram: int = 1,
                      earliest: bool = False) -> Iterator[list[int]]:
    """Every earlier match of a suffix n-gram of ``context``, as the up to ``n`` tokens that followed it:
    longer n-grams first, and for each the most recent match first (``earliest``: the first)."""
    if n <= 0:
        return
    for size in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        pattern = list(context[-size:])
        starts = range(len(context) - size - 1, -1, -1)
        for start in reversed(starts) if earliest else starts:
            if list(context[start : start + size]) == pattern:
                follow = list(context[start + size : start + size + n])
                if follow:
                    yield follow
