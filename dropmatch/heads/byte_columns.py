"""The columns of an LM head in 8 bits, for the sparse dropout heads' corrections on CPUs.

The sparse path (:mod:`dropmatch.heads.dropout`) corrects the clean logits by ``W[:, D] h_D`` over the whole
vocabulary: per position and head, a sum of ~20 columns of W (262k entries each on the embedded pair).
Its cost is the bytes of those columns. Here each column of W, cut into vocabulary blocks, is quantized
to 8 bits with its own scale and offset (fbgemm's row-wise format, ``embedding_bag_byte_prepack``), and
fbgemm's embedding bags sum them straight to float32: a quarter of float32's bytes and half of bfloat16's,
with no bfloat16 rounding of the sums.

**Error bound.** The dequantization error of every entry is measured once per column j, over all its blocks,
as ``error[j]`` (no assumption about rounding modes). fbgemm sums a bag in order, one thread per bag: for
each dropped column j with weight w_j = h_j / (1 - p) (rounded to float32) it forms w_j scale and w_j offset
and accumulates ``fma(w_j scale, q, acc + w_j offset)``: two roundings relative to the running sum and a few
relative to |w_j| ``magnitude[j]`` (``magnitude[j] = max (255 |scale| + |offset|)``, which also covers the
float32 rounding of the measured dequantized values). So for a head with dropped set D the computed
correction is within

    1.05 * sum_{j in D} |h_j| (error[j] + (|D| + 6) 2^-23 magnitude[j]) / (1 - p)

of the exact one at every token: one number per head, as :func:`~dropmatch.rules.dropmatch.tail_certified_decide`
reads (:func:`byte_correction_bounds` gives it without the 1 / (1 - p), in units of ``W[:, D] h_D``, as the
other sparse bounds). On the embedded pair it is ~0.02-0.06 nats at p_drop = 0.032, about a fifth of the
bfloat16 path's bound (whose output rounding and Cauchy-Schwarz terms dominate). The bound is against
float32 products, the exact heads of a float32 head weight: ``DropoutHead`` takes 8-bit columns for those only.

**Natively** (x86-64 Linux with a C compiler, :func:`~dropmatch.kernels.byte_column_sums`) one position's K heads
are summed together: a column that several heads drop carries the same weight in each, so the dropped columns
are grouped by the set of heads that drop them and each group's sum is added to its heads. The kernel's roundings
(at most |D| + G + 3 of the same size, with G <= |D| groups holding the head) stay inside the bound above (tested
against float64 sums), and a column is read once per position rather than once per head. A random 262k x 640
weight, K = 5, one position, caches flushed, 2-core AVX2 EPYC, medians of 11 interleaved: 26 against 81 ms for
fbgemm's bags at p_drop 0.3 and 6.2 against 10.7 ms at 0.032, in a slow hour of that machine (an hour earlier
this kernel's prototype took 14.8 and 2.4 ms, and the bags 43-57 and 2.7-4.9 ms). Those were its first
version; the current one takes ~0.6 and ~0.8 of its time (``byte_columns.c``).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ..onednn_linear import memory_key, weight_stamp

BYTE_ROWWISE = torch.quint8  # the ``sparse_dtype`` that names this format (8-bit row-wise W^T blocks)
# vocabulary columns per block: twice the float blocks' (the sums of a bag still fit in cache), measured with
# the caches flushed as a verify step leaves them (a random weight of the embedded pair's 262k x 640, K = 5,
# p_drop = 0.032, 2-core AMX Xeon): 1.16 ms at 32768 against 1.42 ms at 16384, 1.38 ms at 65536 and 1.82 ms
# for whole columns
BYTE_VOCAB_BLOCK = 32768


@functools.cache
def byte_bags_supported() -> bool:
    """Whether this torch runs fbgemm's 8-bit row-wise embedding bags (x86 CPU builds)."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines or "x86" in engines


def byte_columns_supported(weight: torch.Tensor) -> bool:
    """Whether 8-bit columns may serve ``weight``: a float32 CPU weight (the bound is against float32 products,
    the exact heads of a float32 head only) on a torch with fbgemm."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and byte_bags_supported()


@dataclass(eq=False)
class ByteBlocks:
    """W^T in vocabulary blocks, 8 bits a entry: ``packed`` (n_blocks * d, width + 8) uint8 (row ``b * d + j``
    holds column j of W over block b, then its float32 scale and offset); ``error`` and ``magnitude`` (d,)
    float32 per column of W: the largest dequantization error and the largest 255 |scale| + |offset| over
    its blocks."""

    packed: torch.Tensor
    error: torch.Tensor
    magnitude: torch.Tensor

    @property
    def width(self) -> int:
        return self.packed.shape[1] - 8


_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (weight memory, version, block) -> blocks


def shared_byte_blocks(weight: torch.Tensor, block: int) -> ByteBlocks:
    """:class:`ByteBlocks` of ``weight`` (V, d) in vocabulary blocks of ``block`` columns (the last one
    zero-padded), built once per weight memory, version and block and shared while one head holds them
    (168 MB for the embedded pair)."""
    key = (*memory_key(weight), weight_stamp(weight)[0], block)
    blocks = _SHARED.get(key)
    if blocks is None:
        vocab, d = weight.shape
        width = min(block, vocab)
        packed, errors, magnitudes = [], [], []
        for start in range(0, vocab, width):
            columns = torch.zeros((d, width), dtype=torch.float32)
            rows = weight.detach()[start : start + width].float()
            columns[:, : rows.shape[0]] = rows.T
            chunk = torch.ops.quantized.embedding_bag_byte_prepack(columns)  # (d, width + 8)
            scale, offset = (chunk[:, width + 4 * i : width + 4 * i + 4].contiguous().view(torch.float32)
                             for i in (0, 1))  # (d, 1) each
            errors.append((chunk[:, :width].float() * scale + offset - columns).abs().amax(1))
            magnitudes.append(255 * scale.abs().squeeze(1) + offset.abs().squeeze(1))
            packed.append(chunk)
        blocks = _SHARED[key] = ByteBlocks(torch.cat(packed), torch.stack(errors).amax(0),
                                           torch.stack(magnitudes).amax(0))
    return blocks


def byte_bag_sums(blocks: ByteBlocks, indices: torch.Tensor, offsets: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """``F.embedding_bag(indices, rows, offsets, mode="sum", per_sample_weights=weights)`` over the
    dequantized rows of ``blocks.packed``: (n_bags, width) float32."""
    return torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
        blocks.packed, indices, offsets, False, 0, False, weights.float(), None, False)


def byte_correction_bounds(blocks: ByteBlocks, hidden: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """Bounds (n, K), in units of ``W[:, D] h_D``, on the error of its 8-bit row-wise evaluation at every token
    (see the module docstring): ``hidden`` (n, d), ``dropped`` (n, K, d) bool."""
    coeff = hidden.float().abs().unsqueeze(1) * dropped  # (n, K, d)
    count = dropped.sum(-1)  # (n, K)
    return 1.05 * (coeff @ blocks.error + (count + 6) * 2.0**-23 * (coeff @ blocks.magnitude))
