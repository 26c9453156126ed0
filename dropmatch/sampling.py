"""Sampling settings and the small tensor helpers every rule and drafter shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy decoding.

    Under greedy decoding, rules that need a distribution (JS, typical acceptance, divergence
    thresholds) use the untempered softmax of the logits.
    """

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Distribution(s) over the vocabulary, float32, same leading shape as ``logits``."""
        logits = logits.float()
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return top_p_filter(probs, self.top_p) if self.top_p < 1 else probs


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample_with_uniform(probs: torch.Tensor, u: torch.Tensor | float) -> torch.Tensor:
    """Inverse-CDF sample of one token per row of ``probs`` (..., V) with uniforms ``u`` (...).

    Taking the uniforms as input keeps random-number use independent of decisions, so two
    code paths that make the same decisions consume the generator identically.
    """
    cdf = probs.float().cumsum(dim=-1)
    u = torch.as_tensor(u, dtype=cdf.dtype, device=cdf.device)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def choose_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """Argmax under greedy decoding, else one sample from the tempered / top-p distribution."""
    if sampling.greedy:
        return int(logits.argmax())
    u = torch.rand((), generator=generator)
    return int(sample_with_uniform(sampling.probs(logits), u))
