"""Drafters propose the next tokens; the engine verifies them with the target.

A drafter sees the context only through ``start`` (the prompt) and ``commit`` (what the target
kept), so it can keep its own state: a KV cache for a draft model, the token history for n-gram
lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import ConfigError
from .models import CausalLM, rollback
from .sampling import SamplingConfig, sample_with_uniform


@dataclass(frozen=True)
class Draft:
    """Proposed tokens (n,) int64; their distributions (n, V) float32 when sampling (speculative
    sampling needs them), and the draft logits (n, V) for rules that want q under greedy decoding.
    Both are ``None`` for drafters without a model."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Reset for a new sequence; ``prompt_ids`` (n,) are the prompt tokens."""

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        """Up to ``n`` tokens following the context plus ``last_token`` (the newest emitted token)."""

    def commit(self, n_accepted: int) -> None:
        """The target kept the first ``n_accepted`` tokens of the last proposal."""


class ModelDrafter:
    """A small causal LM with its own KV cache.

    Invariant between steps: the cache holds every context token except ``pending`` ones, which
    the next ``propose`` feeds in one forward pass together with ``last_token``.
    Greedy drafts take the argmax; under sampling the draft samples from its own tempered /
    top-p distribution (needed for speculative sampling to stay lossless).
    """

    name = "model"

    def __init__(self, model: CausalLM):
        self.model = model
        self.cache = None
        self._pending: list[int] = []
        self._proposed: list[int] = []

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.cache, _ = self.model.new_cache(rollback=True, prompt_ids=prompt_ids)
        self._pending, self._proposed = [], []

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        device = self.model.device
        feed = self._pending + [last_token]
        if n <= 0:
            self._pending, self._proposed = feed, []
            return Draft(torch.empty(0, dtype=torch.long, device=device))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(n):
            logits = self.model.logits(torch.tensor(feed, device=device), self.cache)
            if sampling.greedy:
                token, row = int(logits.argmax()), logits
            else:
                row = sampling.probs(logits)
                token = int(sample_with_uniform(row, torch.rand((), generator=generator)))
            tokens.append(token)
            rows.append(row)
            feed = [token]
        # The cache now holds the context, last_token and all proposals but the newest one.
        self._pending = []
        self._proposed = tokens
        stacked = torch.stack(rows)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        return Draft(ids, logits=stacked) if sampling.greedy else Draft(ids, probs=stacked)

    def commit(self, n_accepted: int) -> None:
        n = len(self._proposed)
        if n == 0:
            return
        if n_accepted == n:
            self._pending = [self._proposed[-1]]  # never fed: goes in with the next token
        rollback(self.cache, max(n - 1 - n_accepted, 0))


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n-gram
    (n from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.
    No model and no distributions (verification treats the draft as one-hot)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []
        self._proposed: list[int] = []
        self.device = torch.device("cpu")

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.context = prompt_ids.tolist()
        self.device = prompt_ids.device
        self._proposed = []

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        self.context.append(last_token)
        tokens = lookup(self.context, n, self.max_ngram, self.min_ngram)
        self._proposed = tokens
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device))

    def commit(self, n_accepted: int) -> None:
        self.context.extend(self._proposed[:n_accepted])


def lookup(context: Sequence[int], n: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Tokens following the most recent earlier match of the longest matching suffix n-gram."""
    if n <= 0:
        return []
    for size in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        pattern = list(context[-size:])
        for start in range(len(context) - size - 1, -1, -1):
            if list(context[start : start + size]) == pattern:
                follow = list(context[start + size : start + size + n])
                if follow:
                    return follow
    return []
