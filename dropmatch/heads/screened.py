"""Dropout-free LM-head logits with an exact argmax, computed mostly in bfloat16.

On the embedded pair the LM head (262,144 x 640) is over half of a verify step, and a float32 GEMM
with L + 1 = 6 rows runs at a fraction of the memory bandwidth on this CPU while a bfloat16 GEMM
(AMX) reads half the bytes at full speed. :class:`ScreenedHead` computes every logit in bfloat16,
bounds the error of each one rigorously, and recomputes in float32 every token that could be the
maximum (and every token within ``refine_margin`` nats of it), so that

* the argmax equals the float32 argmax (greedy verification stays exact; the recomputed values are
  rounded once from float64, so they do not depend on which other tokens are recomputed), and
* the most likely tokens carry float32 values; the others are off by at most their bound
  (bfloat16 rounding, ~0.4 % of |W_v| |h|), which does not move probabilities that matter.

Error bound for token v and row x (bfloat16 unit roundoff u = 2^-8, fp32 accumulation over d terms):
|l~_v - l_v| <= (2u + u^2 + 2 d 2^-24) ||W_v|| ||x|| + u |l~_v| (output rounding), times 1.05 for slack.
Used for greedy decoding only; sampling uses the plain float32 head.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..onednn_linear import FewRowLinear, shared_few_row_linear
from ..sampling import rows_at_least

_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def rounding_bound(dtype: torch.dtype, d: int, max_row_norm: float, x_norm: torch.Tensor,
                   out_magnitude: torch.Tensor) -> torch.Tensor:
    """Bound on |W x - fl(W x)| per logit for a GEMM whose inputs are rounded to ``dtype`` (fp32
    accumulation over ``d`` terms, output rounded to ``dtype``), in logits: (2u + u^2 + 2 d 2^-24)
    max_v ||W_v|| ||x|| + u / (1 - u) |output|, times 1.05 for slack. Zero for float32 or wider
    (float32 is the reference precision of "exact" logits). ``x_norm`` and ``out_magnitude`` broadcast.
    """
    u = _UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return torch.zeros_like(x_norm * out_magnitude)
    return 1.05 * (2 * u + u * u + 2 * d * 2.0**-24) * max_row_norm * x_norm + 1.05 * u / (1 - u) * out_magnitude


class ScreenedHead:
    """Logits (n, V) float32 whose argmax is exact; see the module docstring.

    Args:
        weight: float32 LM-head weight (V, d).
        weight_bf16: the same in bfloat16, if already at hand.
        refine_margin: tokens within this many nats of the maximum, beyond the error margin, are
            recomputed in float32 too (their probabilities are then exact).
        max_refined: above this many tokens to recompute, a row is recomputed fully in float32.
    """

    def __init__(self, weight: torch.Tensor, weight_bf16: torch.Tensor | None = None, refine_margin: float = 4.0,
                 max_refined: int = 16384):
        self.weight = weight.detach().float()
        self.weight_bf16 = self.weight.to(torch.bfloat16) if weight_bf16 is None else weight_bf16
        # the bfloat16 GEMM: oneDNN with a reordered copy on CPUs with native bfloat16 (5.6 ms for 1 row
        # of 262k x 640 against 15.8 ms by F.linear), F.linear elsewhere; same rounding model (bf16
        # inputs and output, float32 accumulation), so the same bound
        self.kernel: FewRowLinear = shared_few_row_linear(self.weight_bf16)
        self.max_row_norm = float(self.weight.norm(dim=1).max())
        self.refine_margin = refine_margin
        self.max_refined = max_refined

    def error_bound(self, approx: torch.Tensor, hidden: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
        """Bound (n, 1) on max_v |approx - exact| for bfloat16 logits ``approx`` (n, V) of ``hidden`` (n, d);
        ``top``: their row maxima (n, 1), if at hand."""
        top = approx.amax(-1, keepdim=True) if top is None else top
        magnitude = torch.maximum(top, -approx.amin(-1, keepdim=True))
        x_norm = hidden.float().norm(dim=-1, keepdim=True)
        return rounding_bound(torch.bfloat16, self.weight.shape[1], self.max_row_norm, x_norm, magnitude)

    def __call__(self, hidden: torch.Tensor, extra: torch.Tensor | None = None):
        """Logits (n, V); with ``extra`` rows (m, d), also their plain products (m, V) as the GEMM gives them
        (bfloat16), from the same GEMM (one pass over the weight for both): returns (logits, products)."""
        rows = hidden.to(torch.bfloat16) if extra is None else torch.cat([hidden.to(torch.bfloat16), extra.to(torch.bfloat16)])
        product = self.kernel(rows)
        approx, extra_products = product[: hidden.shape[0]].float(), product[hidden.shape[0] :]
        top = approx.amax(-1, keepdim=True)
        # Any token below max - 2 * bound cannot be the exact maximum.
        threshold = top - 2 * self.error_bound(approx, hidden, top) - self.refine_margin
        row_of, tokens = rows_at_least(approx, threshold)  # every row's candidates at once, row-major
        ends = torch.bincount(row_of, minlength=approx.shape[0]).cumsum(0).tolist()
        for row, (start, end) in enumerate(itertools.pairwise([0, *ends])):
            if end - start > self.max_refined:
                approx[row] = F.linear(hidden[row].float(), self.weight)
            else:
                approx[row, tokens[start:end]] = refined_logits(hidden[row], self.weight, tokens[start:end])
        return approx if extra is None else (approx, extra_products)


def refined_logits(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``hidden`` (d,) times the rows ``tokens`` of ``weight`` (V, d): (len(tokens),) float32, each the
    float64 dot product rounded once. A float32 product over a gathered subset rounds a token's value by
    its place in the subset (a GEMV treats the last rows apart), so two equal rows could come out 1 ulp
    apart and the refined set, which differs between a 1-row and a 6-row step, could flip a tie."""
    return F.linear(hidden.double(), weight[tokens].double()).float()
