"""Drafters propose the next tokens; the engine verifies them with the target.

A drafter sees the context only through ``start`` (the prompt) and ``commit`` (what the target
kept), so it can keep its own state: a KV cache for a draft model, the token history for n-gram
lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..errors import ConfigError
from ..sampling import SamplingConfig


def check_stop_below(stop_below: float | None) -> None:
    """Refuse a draft-confidence stop that is not a probability in (0, 1) (``None``: no stop)."""
    if stop_below is not None and not 0.0 < stop_below < 1.0:
        raise ConfigError(f"the draft stop (--draft-stop) must be a probability in (0, 1), got {stop_below!r}")


def draft_confidence(row: torch.Tensor, token: int, sampling: SamplingConfig) -> float:
    """The draft's probability of its chosen ``token``, what a confidence stop compares with its threshold:
    greedy, ``row`` holds the draft logits and this is the top token's softmax probability; sampling,
    ``row`` holds the draft probabilities the token was sampled from."""
    if sampling.greedy:
        return float(torch.exp(row.max() - torch.logsumexp(row, dim=0)))
    return float(row[token])


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

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Reset for a new sequence; ``prompt_ids`` (n,) are the prompt tokens. ``features`` (n, k d):
        the target's states at its ``feature_layers`` for :class:`FeatureDrafter` s, else ``None``."""

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        """Up to ``n`` tokens following the context plus ``last_token`` (the newest emitted token)."""

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        """The target kept the first ``n_accepted`` tokens of the last proposal. ``features``
        (n_accepted + 1, k d), for :class:`FeatureDrafter` s: the target's states at the newest emitted
        token and the kept draft tokens."""


@runtime_checkable
class FeatureDrafter(Protocol):
    """A drafter that reads the target's hidden states (EAGLE-3): the engine then runs the trunk with
    these ``hidden_states`` indices (the input to decoder layer i) and passes them to ``start``/``commit``."""

    feature_layers: tuple[int, ...]


@runtime_checkable
class FollowingDrafter(Protocol):
    """A drafter that can sit out a step while another one proposes (:class:`~dropmatch.drafters.lookup_first.LookupFirstDrafter`)
    and still keep its state in step with the context."""

    def follow(self, last_token: int, tokens: list[int]) -> None:
        """Instead of ``propose``: another drafter proposed ``tokens`` after ``last_token``. The next
        ``commit`` says how many of them the target kept (with their features, for a :class:`FeatureDrafter`)."""


@runtime_checkable
class GuessingDrafter(Protocol):
    """A :class:`FollowingDrafter` that can say its first token before choosing to propose or follow
    (guided lookup, :class:`~dropmatch.drafters.lookup_first.LookupFirstDrafter`)."""

    def first_guess(self, last_token: int) -> tuple[int, float]:
        """Its greedy first draft token after ``last_token`` and that token's untempered softmax probability
        (whatever the sampling); the step's ``propose`` or ``follow`` (for the same ``last_token``) then goes
        on from there."""
