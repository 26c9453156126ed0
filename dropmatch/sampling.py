"""Sampling settings and the small tensor helpers every rule and drafter shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
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
        # shifted by the maximum first: logits / T alone overflows to inf at a tiny T (NaN probabilities)
        probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / self.temperature, dim=-1)
        return top_p_filter(probs, self.top_p) if self.top_p < 1 else probs


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample_with_uniform(probs: torch.Tensor, u: torch.Tensor | float) -> torch.Tensor:
    """Inverse-CDF sample of one token per row of ``probs`` (..., V) with uniforms ``u`` (...) in [0, 1].

    Taking the uniforms as input keeps random-number use independent of decisions, so two
    code paths that make the same decisions consume the generator identically. Never returns a
    token of probability zero (a row with any mass): a uniform whose target lands at or past the
    float cumulative sum's end (u near 1, rounding) falls back to the last token with mass at or
    before the landing point, else the first token with mass.
    """
    probs = probs.float()
    cdf = probs.cumsum(dim=-1)
    u = torch.as_tensor(u, dtype=cdf.dtype, device=cdf.device).clamp(0.0, 1.0)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    positive = probs > 0
    chosen_ok = positive.gather(-1, index).squeeze(-1)
    index = index.squeeze(-1)
    if bool(chosen_ok.all()):
        return index
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_before = torch.where(positive & (positions <= index.unsqueeze(-1)), positions, -1).amax(dim=-1)
    first = torch.where(positive, positions, probs.shape[-1] - 1).amin(dim=-1)
    fallback = torch.where(last_before >= 0, last_before, first)
    return torch.where(chosen_ok, index, fallback)


ARGMAX_BLOCKS = (1024, 512, 256, 128, 64)  # block lengths the CPU argmax may split a row into


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the first maximum along the last axis, (...,) int64.

    On CPUs over large vocabularies, in two levels of ``amax``: the row's blocks of
    :data:`ARGMAX_BLOCKS` entries, the first block holding the row maximum, the first entry of it equal to
    that maximum. torch's CPU argmax runs at ~1/20 of amax's speed (1.3 ms against 0.05 ms for 6 rows of
    a 262k vocabulary here), and a verify step takes several. Rows with a NaN go to torch's argmax.
    """
    vocab = logits.shape[-1] if logits.dim() else 0
    block = next((b for b in ARGMAX_BLOCKS if vocab % b == 0), 0)
    if (logits.device.type != "cpu" or not logits.is_floating_point() or vocab < 16 * ARGMAX_BLOCKS[0]
            or not block or logits.numel() == 0):
        return logits.argmax(-1)
    rows = logits.reshape(-1, vocab // block, block)  # (n, blocks, block)
    block_max = rows.amax(-1)  # (n, blocks)
    top = block_max.amax(-1, keepdim=True)  # (n, 1)
    if bool(top.isnan().any()):
        return logits.argmax(-1)
    first_block = (block_max == top).to(torch.uint8).argmax(-1)  # (n,): first block with the maximum
    picked = rows[torch.arange(rows.shape[0]), first_block]  # (n, block)
    within = (picked == top).to(torch.uint8).argmax(-1)
    return (first_block * block + within).view(logits.shape[:-1])


_NUMPY_DTYPES = (torch.bool, torch.float16, torch.float32, torch.float64)


def _numpy_view(tensor: torch.Tensor):
    """``tensor``'s memory as a NumPy array (no copy), for a CPU tensor of a dtype NumPy has; else ``None``."""
    if tensor.device.type != "cpu" or tensor.dtype not in _NUMPY_DTYPES:
        return None
    return tensor.detach().numpy()


def true_indices(mask: torch.Tensor) -> torch.Tensor:
    """``mask.nonzero().flatten()`` of a 1-D bool ``mask``: (n,) int64, ascending. On CPUs by NumPy's
    ``flatnonzero`` (262k entries of which ~500 are set: 0.03 against 0.09 ms for torch's ``nonzero``)."""
    view = _numpy_view(mask)
    return mask.nonzero().flatten() if view is None else torch.from_numpy(np.flatnonzero(view))


def rows_at_least(values: torch.Tensor, thresholds: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values >= thresholds[:, None]).nonzero(as_tuple=True)`` of a 2-D ``values`` (n, V) and one
    threshold per row (n,), in ``values``' dtype: the rows and columns (int64) in row-major order. On CPUs by
    NumPy where it has the dtype (a 262k vocabulary where ~500 entries reach the threshold: 0.04 ms a row,
    against ~0.12 ms for the blocked search below and ~0.15 ms for torch's comparison and ``nonzero``);
    else, over long rows, in two levels: the blocks of ``block`` entries whose maximum reaches their row's
    threshold, then their entries."""
    n, width = values.shape
    if thresholds.dtype != values.dtype:
        raise ValueError(f"thresholds are {thresholds.dtype}, values {values.dtype}: compare in one dtype")
    limits = thresholds.reshape(n, 1)
    view, limit_view = _numpy_view(values), _numpy_view(limits)
    if view is not None and limit_view is not None:  # the same comparison, in the values' dtype
        flat = torch.from_numpy(np.flatnonzero(view >= limit_view))  # (a 2-D np.nonzero takes ~10x longer)
        return flat // width, flat % width
    if values.device.type != "cpu" or width % block or width < 64 * block:
        return (values >= limits).nonzero(as_tuple=True)
    blocks = values.view(n, width // block, block)
    # a block with a NaN is searched (its maximum is NaN)
    rows, hit = (~(blocks.amax(-1) < limits)).nonzero(as_tuple=True)
    inner, cols = (blocks[rows, hit] >= limits[rows]).nonzero(as_tuple=True)
    return rows[inner], hit[inner] * block + cols


def indices_at_least(values: torch.Tensor, threshold: float, block: int = 64) -> torch.Tensor:
    """``(values >= threshold).nonzero()`` of a 1-D ``values``: (n,) int64, ascending (see
    :func:`rows_at_least`). A float threshold is rounded to the values' floating dtype, as torch rounds a
    Python number (beyond its range: to +-inf). Off the CPU (one level anyway) and for integer values, the
    comparison takes the Python number itself: no threshold tensor to copy to the device."""
    if values.device.type != "cpu" or not values.is_floating_point():
        return (values >= threshold).nonzero().flatten()
    limit = torch.tensor([threshold], dtype=torch.float64).to(values.dtype)
    return rows_at_least(values.view(1, -1), limit, block)[1]


def choose_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """Argmax under greedy decoding, else one sample from the tempered / top-p distribution."""
    if sampling.greedy:
        return int(argmax(logits))
    u = torch.rand((), generator=generator)
    return int(sample_with_uniform(sampling.probs(logits), u))
