"""The K-sample Monte-Carlo-dropout LM head (DropMatch, Sec. 3.1).

Dropout goes on the *input* of the unchanged LM head only: for a last hidden state h (d,),
head i sees h * m_i / (1 - p_drop) with m_i ~ Bernoulli(1 - p_drop)^d. The trunk and the KV cache
run once. Head logits are computed as the dropout-free logits plus the logit perturbation

    W (h * m_i / (1 - p) - h)  =  W (h * (m_i / (1 - p) - 1)),

which is the same quantity as ``W (h * m_i / (1 - p))`` in exact arithmetic, and lets the perturbation
GEMM run in a faster dtype (bfloat16 by default) while the dropout-free logits stay in the model's
own precision. With p_drop = 0 the perturbation is exactly zero, so every head equals the
dropout-free head bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .screened import bf16_matmul_supported


def check_dropout_args(k: int, p_drop: float) -> None:
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"K (number of dropout heads) must be an integer >= 1, got {k!r}")
    if not 0.0 <= p_drop < 1.0:
        raise ConfigError(f"p_drop must be in [0, 1), got {p_drop!r}")


def default_head_dtype(weight: torch.Tensor) -> torch.dtype:
    """Dtype of the perturbation GEMM for an LM-head ``weight``: bfloat16 (float16 for float16
    weights), except float32 on CPUs without native bfloat16 GEMMs."""
    if weight.dtype == torch.float16:
        return torch.float16
    if weight.device.type == "cpu" and not bf16_matmul_supported():
        return torch.float32
    return torch.bfloat16


def keep_scale(masks: torch.Tensor, p_drop: float) -> torch.Tensor:
    """Inverted-dropout factors m / (1 - p_drop), float32, of keep-masks ``masks`` (any shape)."""
    return masks.to(torch.float32) / (1.0 - p_drop)


def dropout_inputs(hidden: torch.Tensor, masks: torch.Tensor, p_drop: float) -> torch.Tensor:
    """The heads' inputs h * m / (1 - p_drop), float32: ``hidden`` (n, d), ``masks`` (n, K, d) -> (n, K, d)."""
    return hidden.float().unsqueeze(1) * keep_scale(masks, p_drop)


class DropoutHead:
    """K dropout samples of an LM head.

    Args:
        weight: LM-head weight (V, d), the shared-vocabulary rows.
        k: number of heads K.
        p_drop: dropout probability on the head's input.
        compute_dtype: dtype of the perturbation GEMM; ``None`` picks bfloat16 (float16 for
            float16 weights). Pass ``torch.float32`` for a strict full-precision head.
        softcap: final-logit soft-capping of the model (Gemma-2), or ``None``.
        weight_in_compute_dtype: ``weight`` already converted, to share one copy.
    """

    def __init__(self, weight: torch.Tensor, k: int = 5, p_drop: float = 0.3,
                 compute_dtype: torch.dtype | None = None, softcap: float | None = None,
                 weight_in_compute_dtype: torch.Tensor | None = None):
        check_dropout_args(k, p_drop)
        self.k, self.p_drop, self.softcap = k, float(p_drop), softcap
        if compute_dtype is None:
            compute_dtype = torch.float16 if weight.dtype == torch.float16 else torch.bfloat16
        self.compute_dtype = compute_dtype
        self.weight = weight.detach()
        if weight_in_compute_dtype is None:
            weight_in_compute_dtype = self.weight.to(compute_dtype)
        self._weight_c = weight_in_compute_dtype

    def draw_masks(self, n_positions: int, generator: torch.Generator) -> torch.Tensor:
        """Keep-masks (n_positions, K, d), bool, drawn on the CPU generator for reproducibility."""
        d = self.weight.shape[1]
        uniform = torch.rand((n_positions, self.k, d), generator=generator)
        return (uniform >= self.p_drop).to(self.weight.device)

    def perturbation_inputs(self, hidden: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Rows (n * K, d) in the compute dtype whose head products are the logit perturbations."""
        delta = hidden.float().unsqueeze(1) * (keep_scale(masks, self.p_drop) - 1.0)  # (n, K, d)
        return delta.reshape(-1, delta.shape[-1]).to(self.compute_dtype)

    def combine(self, clean_logits: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
        """Head logits (n, K, V) from the dropout-free logits (n, V) and the products (n * K, V)."""
        n = clean_logits.shape[0]
        return clean_logits.unsqueeze(1) + products.float().view(n, self.k, -1)

    def logits(self, hidden: torch.Tensor, clean_logits: torch.Tensor, masks: torch.Tensor,
               products: torch.Tensor | None = None) -> torch.Tensor:
        """Head logits (n, K, V) float32.

        Args:
            hidden: last hidden states (n, d).
            clean_logits: dropout-free logits (n, V) float32 (after soft-capping if any).
            masks: keep-masks (n, K, d) from :meth:`draw_masks`.
            products: ``W @ perturbation_inputs(hidden, masks).T`` if already computed (e.g. fused
                into the verification GEMM), else computed here.
        """
        if self.softcap:  # capped logits are not additive in the perturbation: compute directly
            raw = F.linear(dropout_inputs(hidden, masks, self.p_drop).to(self.weight.dtype), self.weight).float()
            return torch.tanh(raw / self.softcap) * self.softcap
        if products is None:
            products = F.linear(self.perturbation_inputs(hidden, masks), self._weight_c)
        return self.combine(clean_logits, products)
