"""The LM head in int8 for oneDNN's int8 GEMM, for sparse dropout heads that drop many columns (CPUs).

The 8-bit corrections ``W[:, D] h_D`` of :mod:`~dropmatch.heads.byte_columns` are embedding bags: their cost
grows with the dropped columns, and past about one d of them for a position's K heads (K p_drop ~ 1) one
dense pass over all of W costs less. Here W (V, d) is held as

    W ~ diag(s) Q diag(a),   Q int8 in [-127, 127] (V, d),  a_j = max_v |W_vj|,  s_v = max_j |W_vj / a_j| / 127,

(each column scaled to [-1, 1], then each row quantized), so ``W x = s * (Q (a * x))``: the column scales ride
in the input, the row scales are the int8 GEMM's per-output-channel scales, and oneDNN multiplies int8 by
int8 into exact int32 sums (AMX / AVX512-VNNI, no int16 saturation). The input u = a * x, one row per head,
is quantized in two levels (u ~ t1 q1 + t2 q2, each row with its own scales), two GEMM rows a head, so
the input's rounding is ~1 / 64,000 of its largest entry. On the embedded pair (262k x 640, 168 MB) a
position's K = 5 heads take ~8.8 ms where the bags at p_drop 0.3 take ~15 ms.

**Error bound**, at every token v, for a row x with u = a * x and residual r2 = u - t1 q1 - t2 q2:

    |W_v x - computed_v| <= 1.05 (sum_j error[j] |x_j| + gain (max |r2| + 2^-21 (max |u| + max |u - t1 q1|)))

with ``error[j]`` = max_v |W_vj - s_v Q_vj a_j| measured once per column (plus 2^-22 a_j for the float32
rounding of that measurement), and ``gain`` = max_v s_v sum_j |Q_vj|, which bounds |s_v Q_v . e| / max |e|
for the input's residual. The 2^-21 (8 units of 2^-24) covers the float32 roundings of each level's products,
relative to gain times that level's largest input: fl(a x), fl(q t) (the subtractions that form the residuals
are exact), the int32 sum's conversion to float32 (exact below 2^24, i.e. d <= 1040; else one rounding), the
products by s_v, by the step and by the scale (about 7 of the 8). An offset adds two roundings relative to
the result (charged by its caller). oneDNN is checked once to sum exactly (:func:`int8_gemm_supported`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ..onednn_linear import memory_key, weight_stamp


@functools.cache
def int8_gemm_supported() -> bool:
    """Whether this CPU and torch run oneDNN's int8 GEMM with exact int32 sums: AMX or AVX512-VNNI (older
    int8 instructions add pairs of products in saturating int16), torch's ``onednn.qlinear`` ops, and a GEMM of
    extreme int8 values that comes out exact (oneDNN may be capped below the CPU, ``ONEDNN_MAX_CPU_ISA``)."""
    try:
        ops = hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(torch.ops.onednn, "qlinear_pointwise")
        return bool(ops and torch.backends.mkldnn.is_available()
                    and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_vnni_supported())
                    and _sums_are_exact())
    except (AttributeError, RuntimeError):
        return False


def _sums_are_exact() -> bool:
    """One int8 GEMM whose pairs of products overflow int16 (+-127 x +-127, unit scales): exact int32 sums
    equal the float64 product; saturating or range-reduced kernels do not."""
    g = torch.Generator().manual_seed(0)
    weight = torch.where(torch.rand(64, 256, generator=g) < 0.5, -127, 127).to(torch.int8)
    inputs = torch.stack([torch.full((256,), 127), torch.full((256,), -127), weight[0].long(), -weight[1].long()])
    packed = torch.ops.onednn.qlinear_prepack(weight, None)
    sums = torch.ops.onednn.qlinear_pointwise(inputs.to(torch.int8), 1.0, 0, packed, torch.ones(64),
                                              torch.zeros(64, dtype=torch.long), None, 1.0, 0, torch.float32,
                                              "none", [], "")
    return bool(torch.equal(sums.double(), inputs.double() @ weight.double().T))


@dataclass(eq=False)
class Int8Weight:
    """W (V, d) as ``diag(row_scale) Q diag(column_scale)``: ``packed`` Q for oneDNN, ``row_scale`` (V,) and
    ``column_scale`` (d,) float32, ``error`` (d,) the largest error of each column, ``gain`` max_v s_v ||Q_v||_1."""

    packed: torch.Tensor
    row_scale: torch.Tensor
    column_scale: torch.Tensor
    error: torch.Tensor
    gain: float

    def __post_init__(self):
        self._zero_points = torch.zeros(self.row_scale.shape[0], dtype=torch.long)


_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (weight memory, version) -> Int8Weight


def shared_int8_weight(weight: torch.Tensor, chunk: int = 32768) -> Int8Weight:
    """:class:`Int8Weight` of a float32 CPU ``weight`` (V, d), built once per weight memory and version (in
    vocabulary chunks of ``chunk`` rows) and shared while one head holds it (168 MB for the embedded pair)."""
    key = (*memory_key(weight), weight_stamp(weight)[0])
    held = _SHARED.get(key)
    if held is not None:
        return held
    w = weight.detach()
    column_scale = w.abs().amax(0)
    column_scale = torch.where(column_scale > 0, column_scale, 1.0)
    quantized, row_scales, errors, gain = [], [], [], 0.0
    for rows in w.split(chunk):
        normalized = rows.float() / column_scale
        row_scale = normalized.abs().amax(1) / 127
        row_scale = torch.where(row_scale > 0, row_scale, 1.0)
        q = torch.round(normalized / row_scale.unsqueeze(1)).clamp_(-127, 127)
        errors.append((q * row_scale.unsqueeze(1) * column_scale - rows).abs().amax(0))
        gain = max(gain, float((q.abs().sum(1) * row_scale).max()))
        quantized.append(q.to(torch.int8))
        row_scales.append(row_scale)
    error = torch.stack(errors).amax(0) + 2.0**-22 * column_scale
    packed = torch.ops.onednn.qlinear_prepack(torch.cat(quantized), None)
    held = _SHARED[key] = Int8Weight(packed, torch.cat(row_scales), column_scale, error, gain)
    return held


def _two_levels(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``u`` (m, d) float32 as t1 q1 + t2 q2 + r2 per row: (q1; q2) (2m, d) int8, scales (t1; t2) (2m, 1),
    the residuals' largest entries max |r2| and max |u - t1 q1| (m,)."""
    levels, scales, residual_max, residual = [], [], [], u
    for _ in range(2):
        scale = residual.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, 1.0)
        q = torch.round(residual / scale).clamp_(-127, 127)
        residual = residual - q * scale
        levels.append(q)
        scales.append(scale)
        residual_max.append(residual.abs().amax(-1))
    return torch.cat(levels).to(torch.int8), torch.cat(scales), residual_max[1], residual_max[0]


def int8_products(weight: Int8Weight, x: torch.Tensor, scale: float = 1.0,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """``offset + scale * W x`` for the rows of ``x`` (..., d): (..., V) float32, from one int8 GEMM of two rows a
    row of ``x``; ``offset`` broadcast against the result (e.g. (n, 1, V) for x (n, K, d)), or ``None`` (zero).
    The offset costs two more roundings of the result."""
    rows = x.reshape(-1, x.shape[-1])
    levels, steps, _, _ = _two_levels(rows.float() * weight.column_scale)
    sums = torch.ops.onednn.qlinear_pointwise(levels, 1.0, 0, weight.packed, weight.row_scale, weight._zero_points,
                                              None, 1.0, 0, torch.float32, "none", [], "")  # s_v (Q_v . q)
    m, shape = rows.shape[0], (*x.shape[:-1], -1)
    steps = steps * scale
    first, second = sums[:m].view(shape), sums[m:].view(shape)
    first_steps, second_steps = steps[:m].view(*x.shape[:-1], 1), steps[m:].view(*x.shape[:-1], 1)
    first = first.mul_(first_steps) if offset is None else torch.addcmul(offset, first, first_steps)
    return first.addcmul_(second, second_steps)


def int8_product_bounds(weight: Int8Weight, x: torch.Tensor) -> torch.Tensor:
    """Bounds (...,) on the error of :func:`int8_products` of the rows of ``x`` (..., d) at every token, in units
    of ``W x`` (before the scale, without an offset's roundings; see the module docstring). Zero for a zero row
    (its products are exact zeros)."""
    u = x.float() * weight.column_scale
    _, _, residual, first_residual = _two_levels(u)
    rounding = 2.0**-21 * (u.abs().amax(-1) + first_residual)
    return 1.05 * (x.float().abs() @ weight.error + weight.gain * (residual + rounding))
