"""The K dropout heads at vLLM's verify positions, through the model's own ``compute_logits``.

Masks are drawn on a CPU generator seeded from (seed, request key, absolute position), so every
tensor-parallel rank draws the same masks, a request's masks do not depend on its batch, and a run
is reproducible. Going through ``compute_logits`` keeps vocabulary-parallel (TP all-gather),
quantized and soft-capped heads working without touching their weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from ..heads.dropout import dropout_inputs

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]


def position_seed(seed: int, request_key: int, position: int) -> int:
    """A 63-bit generator seed from (seed, request key, absolute token position); stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{request_key}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def request_key(prompt_token_ids: Sequence[int] | None) -> int:
    """A stable key of a request's prompt (its length and first 64 tokens)."""
    ids = list(prompt_token_ids or ())
    head = ",".join(map(str, ids[:64]))
    digest = hashlib.blake2b(f"{len(ids)}|{head}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def draw_masks(seeds: Sequence[int], k: int, d: int, p_drop: float, device: torch.device) -> torch.Tensor:
    """Keep-masks (m, K, d) bool, one generator per position."""
    masks = torch.empty((len(seeds), k, d), dtype=torch.bool)
    generator = torch.Generator()
    for i, seed in enumerate(seeds):
        generator.manual_seed(seed)
        masks[i] = torch.rand((k, d), generator=generator) >= p_drop
    return masks.to(device)


def dropout_head_logits(compute_logits: ComputeLogits, hidden: torch.Tensor, masks: torch.Tensor,
                        p_drop: float) -> torch.Tensor:
    """Head logits (m, K, V) float32 of hidden states (m, d) under keep-masks (m, K, d).

    The heads' inputs h * m / (1 - p_drop) go through ``compute_logits`` in the model's dtype as one
    (m * K, d) batch; with p_drop = 0 they equal ``hidden`` exactly.
    """
    m, k, d = masks.shape
    inputs = dropout_inputs(hidden, masks, p_drop).to(hidden.dtype).reshape(m * k, d)
    logits = compute_logits(inputs)
    return logits.float().view(m, k, -1)
