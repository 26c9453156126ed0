"""float32 linear layers for the few-row GEMMs of decoding on CPUs: oneDNN with prepacked weights, or a native
kernel that streams the weight in its own layout.

A verify step runs the trunk on L + 1 = 6 rows. torch's float32 ``F.linear`` (MKL) handles so few rows
poorly: on the embedded Gemma-3-270M (2 cores) the trunk takes ~100 ms on 6 rows against ~50 ms on 1,
although both read the same 400 MB of weights. oneDNN with a weight reordered once for its kernels
(``torch.ops.mkldnn._reorder_linear_weight``, as torch's inductor uses it) runs the 6 rows in ~40 ms.
On CPUs without AVX-512, calls of up to :data:`NATIVE_MAX_ROWS` float32 rows take
``dropmatch/kernels/few_rows.c`` instead (:func:`native_few_rows_preferred`; faster on an AVX2 EPYC, see
:data:`NATIVE_MAX_ROWS`): it streams the weight in its own layout, prefetching ahead, and computes each output
row the same way whatever the rows beside it. Results are float32 GEMMs in another summation order (differences
~1e-7 relative), like any change of BLAS; greedy equality of SD and AR is a test on the real pair. Prefill-sized
inputs (many rows) keep ``F.linear``, which is efficient there; so do autograd and non-CPU weights. bfloat16
weights take oneDNN where the CPU runs bfloat16 natively (:func:`bf16_matmul_supported`; e.g. an EAGLE-3 head
drafting in bfloat16), else ``F.linear``. Each layer that oneDNN serves holds a reordered copy of its weight
(the trunk's memory twice over), reordered again when the weight changes (:func:`weight_stamp`): a checkpoint
loaded into the module, an optimizer step, a swapped ``.data`` or an assigned Parameter never leaves a stale
copy behind. The native kernel reads the weight itself and keeps no copy.
"""

from __future__ import annotations

import copy
import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

MAX_ROWS = 64  # inputs with more rows (prefill) use F.linear
NATIVE_MAX_ROWS = 16  # float32 inputs of at most this many rows take the native kernel where it is preferred.
# AVX2 EPYC (2 cores, 2026-12-07), medians of 9 interleaved, ms, oneDNN against native: the trunk's 126 linears
# 30 / 21 (1 row), 46 / 32 (9), 62 / 53 (16), 102 / 127 (45); the 262k x 640 head 33 / 31, 55 / 50, 76 / 79,
# 167 / 199


@functools.cache  # a property of the CPU and the torch build: asked on every few-row call
def bf16_matmul_supported() -> bool:
    """Whether this CPU runs bfloat16 GEMMs natively (AVX512-BF16 / AMX). oneDNN's own answer is also yes
    on plain AVX-512 CPUs, which emulate bfloat16 (slower than float32), so the instruction set decides."""
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return onednn and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def native_few_rows_preferred() -> bool:
    """Whether float32 few-row GEMMs take the native kernel (:func:`dropmatch.kernels.few_row_linear`) rather than
    oneDNN: where the kernels run and the CPU lacks AVX-512 (torch's CPU capability is AVX2). CPUs with
    AVX-512 keep oneDNN's 512-bit kernels, which the native one (256-bit vectors) was not measured against."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and kernels.available()


@functools.cache
def onednn_linear_supported() -> bool:
    """Whether this torch has oneDNN's prepacked linear ops (CPU builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def weight_stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor's values may have: its version counter (bumped by every in-place write:
    ``load_state_dict``, an optimizer step, ``mul_`` under ``no_grad``; shared by its views) and its data
    pointer (an assignment to ``.data`` swaps the storage without a bump). Copies derived from a weight
    compare stamps to know they are stale. An inference tensor keeps no version (-1), so a write to it in
    place (possible inside inference mode only) goes unnoticed: load weights outside inference mode."""
    try:
        version = weight._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        version = -1
    return version, weight.data_ptr()


class WeightWatch:
    """Says whether a weight changed since it was last seen: another tensor (compared by identity, as a
    freed weight's memory may be reused at the same version), or the same one with a new
    :func:`weight_stamp`. The one test every copy derived from a weight uses to know it is stale."""

    def __init__(self, weight: torch.Tensor | None = None):
        self._ref: weakref.ref | None = None
        self._stamp: tuple[int, int] | None = None
        if weight is not None:
            self.changed(weight)

    def changed(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` differs from the one seen last (True at the first call); it is then the one seen."""
        stamp = weight_stamp(weight)
        if self._ref is not None and self._ref() is weight and stamp == self._stamp:
            return False
        self._ref, self._stamp = weakref.ref(weight), stamp
        return True


def few_row_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take oneDNN's few-row path at all: float32 or (where the CPU runs it natively)
    bfloat16, on the CPU, with oneDNN's linear ops in this torch."""
    dtype_ok = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_matmul_supported())
    return dtype_ok and weight.device.type == "cpu" and onednn_linear_supported()


def _rows(x: torch.Tensor) -> int:
    """The rows of ``x`` (..., d): its entries over d (0 for an empty tensor)."""
    return x.numel() // x.shape[-1] if x.numel() else 0


class FewRowLinear:
    """``x @ weight.T (+ bias)`` on inputs of at most :data:`MAX_ROWS` rows without autograd: float32 inputs of
    at most :data:`NATIVE_MAX_ROWS` rows through the native kernel where :func:`native_few_rows_preferred`,
    else oneDNN with the weight reordered once (at the first call that uses it, and again after the weight
    changes: :func:`weight_stamp`); ``F.linear`` otherwise.

    Args:
        weight: (out, in) CPU weight, float32 or (where the CPU has native bfloat16 GEMMs) bfloat16; any
            other is always computed by ``F.linear``. Inputs must have the weight's dtype.
        bias: (out,) or ``None``.
    """

    ROWS_HINT = 6  # the batch size oneDNN's weight layout is chosen for (a verify step at L = 5)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        self._watch = WeightWatch()  # the weight as it was reordered

    def supports_weight(self) -> bool:
        """Whether the weight can take the oneDNN path at all (:func:`few_row_weight`)."""
        return few_row_weight(self.weight)

    def applies(self, x: torch.Tensor) -> bool:
        return (0 < _rows(x) <= MAX_ROWS and not torch.is_grad_enabled() and x.dtype == self.weight.dtype
                and x.device.type == "cpu" and self.supports_weight())

    @property
    def native_serves(self) -> bool:
        """Whether calls of up to :data:`NATIVE_MAX_ROWS` rows take the native kernel rather than oneDNN: a
        float32 weight on a CPU where :func:`native_few_rows_preferred` (the kernel keeps no reordered copy)."""
        return self.weight.dtype == torch.float32 and native_few_rows_preferred()

    def prepack(self) -> None:
        """Reorder the weight for oneDNN now (it is otherwise done at the first few-row call), or again if it
        changed since (:func:`weight_stamp`)."""
        changed = self._watch.changed(self.weight)
        if (self.packed is None or changed) and self.supports_weight():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.ROWS_HINT)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The oneDNN product, for an input :meth:`applies` accepts."""
        self.prepack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def native(self, x: torch.Tensor) -> torch.Tensor | None:
        """The native kernel's product, for an input :meth:`applies` accepts, where it takes it: float32 and at
        most :data:`NATIVE_MAX_ROWS` rows, on a CPU where :func:`native_few_rows_preferred`; else ``None``."""
        if _rows(x) > NATIVE_MAX_ROWS or not self.native_serves:
            return None
        return self._native_product(x)

    def native_at(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The product of ``x`` (..., in) on the weight rows ``rows`` (r,) only, (..., r), by the native kernel
        where :attr:`native_serves`, without autograd (equal, bit for bit, to those columns of its whole product;
        no gathered copy of the rows); else ``None``."""
        if not (self.native_serves and x.dim() >= 1 and not torch.is_grad_enabled()):
            return None
        return self._native_product(x, rows)  # None for inputs the kernel does not take (dtype, device)

    def _native_product(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        out = kernels.few_row_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias, rows=rows)
        return None if out is None else out.view(*x.shape[:-1], -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.applies(x):
            return F.linear(x, self.weight, self.bias)
        out = self.native(x)
        return self.onednn(x) if out is None else out


def memory_key(weight: torch.Tensor) -> tuple:
    """What identifies the memory a tensor views: equal views (slices made anew on each call) share it."""
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, str(weight.device))


_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # the weight's memory -> its kernel


def shared_few_row_linear(weight: torch.Tensor) -> FewRowLinear:
    """The one :class:`FewRowLinear` (no bias) of the memory ``weight`` views: every caller reading
    it, through the same tensor or an equal view (``CausalLM.head_weight`` slices anew on each call),
    shares one oneDNN-reordered copy (671 MB for the embedded pair's LM head), built once (and again if the
    weight changes in place). The entry
    lives as long as a caller holds the kernel, which keeps that memory alive."""
    key = memory_key(weight)
    kernel = _SHARED.get(key)
    if kernel is None:
        kernel = _SHARED[key] = FewRowLinear(weight.detach())
    return kernel


class PackedForward:
    """A replacement ``forward`` for one ``nn.Linear``: oneDNN on few rows, the module's own otherwise."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self._kernel: FewRowLinear | None = None  # built at the first call (a module being deep-copied has no weight yet)

    @property
    def kernel(self) -> FewRowLinear:
        """The layer's kernel, built anew where the layer's weight or bias is another tensor than it was
        built on (an assigned ``nn.Parameter``); in-place changes the kernel notices itself."""
        kernel, linear = self._kernel, self.linear
        if kernel is None or kernel.weight is not linear.weight or kernel.bias is not linear.bias:
            kernel = self._kernel = FewRowLinear(linear.weight, linear.bias)
        return kernel

    @property
    def packed(self) -> torch.Tensor | None:
        """The reordered weight, once a few-row call has built it."""
        return None if self._kernel is None else self._kernel.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def __deepcopy__(self, memo: dict) -> PackedForward:
        """A copied module (e.g. the int8 draft's source) gets its own forward, packed from its own weight."""
        return PackedForward(copy.deepcopy(self.linear, memo))


def pack_linears(module: nn.Module) -> int:
    """Give every CPU ``nn.Linear`` under ``module`` whose weight :class:`FewRowLinear` takes (float32, or
    bfloat16 where the CPU has native bfloat16 GEMMs) a :class:`PackedForward` (idempotent). Returns how
    many layers use it; 0 where oneDNN's ops are missing."""
    if not onednn_linear_supported():
        return 0
    count = 0
    for layer in module.modules():
        if type(layer) is not nn.Linear or not few_row_weight(layer.weight):
            continue
        if not isinstance(layer.forward, PackedForward):
            layer.forward = PackedForward(layer)
        count += 1
    return count


def unpack_linears(module: nn.Module) -> None:
    """Undo :func:`pack_linears` (frees the reordered copies; training needs no undo: autograd takes
    torch's own path)."""
    for layer in module.modules():
        if isinstance(getattr(layer, "forward", None), PackedForward):
            del layer.forward


__all__ = ["MAX_ROWS", "bf16_matmul_supported", "FewRowLinear", "few_row_weight", "memory_key", "PackedForward", "shared_few_row_linear", "onednn_linear_supported", "pack_linears", "unpack_linears",
           "WeightWatch", "weight_stamp"]
