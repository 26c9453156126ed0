"""Native CPU kernels: small C sources built on first use with the system C compiler, loaded with ctypes.

They are optional. :func:`head_statistics`, :func:`byte_column_sums`, :func:`byte_column_heads`,
:func:`kept_tokens` and :func:`few_row_linear` return ``None`` where this is not x86-64 Linux with a C compiler and
glibc's vector math library, where ``DROPMATCH_NATIVE=0``, or for tensors they do not take; callers then keep their
torch path, which computes the same quantities.

Build: every ``*.c`` here, into one library, with ``$CC`` (default ``cc``) and ``-march=native``, in
``$DROPMATCH_CACHE/kernels/``, named by a hash of the sources, the flags, the compiler and the CPU's feature
flags (a cache shared by different machines never loads another CPU's build). With no ``-ffast-math``, loading does not change the process's floating-point
mode. The OpenMP pragmas run on the runtime torch itself runs on (its ``libgomp.so.1``, already loaded), so
the kernels add no second thread pool; on a torch without OpenMP they are built single-threaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cpuinfo import cpu_fields
from ..paths import cache_root

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-shared", "-fPIC")
LIBRARIES = ("-lmvec", "-lm")


def _flags() -> tuple[str, ...]:
    return FLAGS + (("-fopenmp",) if torch.backends.openmp.is_available() else ("-fopenmp-simd",))


def _build(target: Path, compiler: str, flags: tuple[str, ...]) -> None:
    """Compile :data:`SOURCES` to ``target`` (atomically: another process may build the same one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built), *LIBRARIES], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, or ``None`` where they cannot be built or loaded here (logged once)."""
    if os.environ.get("DROPMATCH_NATIVE", "1") == "0" or sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    compiler, flags = os.environ.get("CC", "cc"), _flags()
    texts = [source.read_text() for source in SOURCES]
    key = hashlib.sha256("\0".join([*texts, compiler, *flags, *LIBRARIES, cpu_fields().get("flags", "")]).encode())
    target = cache_root() / "kernels" / f"kernels-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(target, compiler, flags)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("native kernels unavailable, using torch instead (%s: %s)", type(error).__name__, detail)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_long
    library.head_statistics.argtypes = [pointer, size, size, size, pointer, ctypes.c_float, pointer, pointer, pointer,
                                        pointer]
    library.head_statistics.restype = ctypes.c_int
    library.byte_column_sums.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer, size, size,
                                         pointer, pointer, ctypes.c_float, size, pointer, pointer, pointer, pointer]
    library.byte_column_sums.restype = ctypes.c_int
    library.kept_tokens.argtypes = [pointer, pointer, ctypes.c_float, ctypes.c_float, size, pointer, size]
    library.kept_tokens.restype = ctypes.c_long
    library.few_row_linear.argtypes = [pointer, size, size, size, pointer, size, size, pointer, pointer, size]
    library.few_row_linear.restype = None
    library.few_row_linear_at.argtypes = [pointer, size, size, size, pointer, size, pointer, size, pointer, pointer,
                                          size]
    library.few_row_linear_at.restype = None
    return library


def available() -> bool:
    """Whether the native kernels run here."""
    return _library() is not None


@dataclass(frozen=True)
class HeadStatistics:
    """What a decision reads of K head logits over the whole vocabulary (:func:`head_statistics`)."""

    centroid: torch.Tensor  # (V,) float32: the heads' mean, (l_1 + ... + l_K) / K
    head_max: torch.Tensor  # (V,) float32: the heads' largest logit at each token
    sums: torch.Tensor  # (K + 1,) float64: sum_v exp of each head and of the centroid, then the draft's if given


def _cpu_float32(tensor: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    return tensor is None or (tensor.device.type == "cpu" and tensor.dtype == torch.float32
                              and tuple(tensor.shape) == shape)


def head_statistics(logits: torch.Tensor, draft: torch.Tensor | None = None, clean: torch.Tensor | None = None,
                    keep: float = 1.0) -> HeadStatistics | None:
    """The centroid, the maximum and the exponential sums of K head logits, in one pass over them.

    Args:
        logits: (K, V) float32 on the CPU, rows contiguous (a row stride of at least V). With ``clean``, the
            heads' corrections instead, which become the heads ``clean / keep - logits`` in place first (the
            float32 operations torch's ``clean / keep - logits`` performs).
        draft: (V,) float32 draft logits, or ``None``.
        clean: (V,) float32 dropout-free logits, or ``None``.
        keep: 1 - p_drop (read with ``clean`` only).

    Returns:
        :class:`HeadStatistics`, the sums ((K + 2,) with a draft) each within a relative 1e-5 (see
        ``head_statistics.c``); ``None`` where the kernels do not run here or do not take these tensors
        (``logits`` then untouched).
    """
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.stride(0) < logits.shape[1] or 0 in logits.shape:
        return None
    k, vocab = logits.shape
    if not (_cpu_float32(logits, (k, vocab)) and _cpu_float32(draft, (vocab,)) and _cpu_float32(clean, (vocab,))):
        return None
    library = _library()
    if library is None:
        return None
    draft = None if draft is None else draft.contiguous()
    clean = None if clean is None else clean.contiguous()
    centroid, head_max = torch.empty(vocab), torch.empty(vocab)
    sums = torch.empty(k + 2, dtype=torch.float64)
    status = library.head_statistics(logits.data_ptr(), k, vocab, logits.stride(0),
                                     None if clean is None else clean.data_ptr(), keep,
                                     None if draft is None else draft.data_ptr(), centroid.data_ptr(),
                                     head_max.data_ptr(), sums.data_ptr())
    return HeadStatistics(centroid, head_max, sums if draft is not None else sums[:-1]) if status == 0 else None


def kept_tokens(head_max: torch.Tensor, draft: torch.Tensor | None, shift: float, threshold: float,
                capacity: int) -> torch.Tensor | None:
    """The tokens where ``torch.maximum(head_max, draft + shift) >= threshold`` (``head_max >= threshold`` without a
    draft), ascending (V,) -> (n,) int64, as torch computes them in float32 (``shift`` and ``threshold`` rounded to
    float32), in one pass (``head_statistics.c``) where torch takes four.

    Args:
        head_max, draft: (V,) float32 on the CPU; ``draft`` may be ``None``.
        capacity: the most tokens wanted: where more reach the threshold, only the first ``capacity + 1`` come back.

    Returns:
        The tokens; ``None`` where the kernels do not run here or do not take these tensors.
    """
    vocab = head_max.shape[0] if head_max.dim() == 1 else 0
    if not (vocab and capacity >= 0 and _cpu_float32(head_max, (vocab,)) and _cpu_float32(draft, (vocab,))):
        return None
    library = _library()
    if library is None:
        return None
    head_max, draft = head_max.contiguous(), None if draft is None else draft.contiguous()
    kept = torch.empty(capacity + 1, dtype=torch.long)
    count = library.kept_tokens(head_max.data_ptr(), None if draft is None else draft.data_ptr(), shift, threshold,
                                vocab, kept.data_ptr(), kept.numel())
    return kept if count < 0 else kept[:count]


def _column_groups(dropped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The union of the dropped columns of K heads (K, d) grouped by the set of heads that drop them (a bit a head):
    the columns group after group (ascending within one), each group's start (groups + 1,) and its heads
    (groups, K) uint8, groups ordered by their bit pattern, so a head's group of its own comes first."""
    k = dropped.shape[0]
    code = (dropped.long() << torch.arange(k).unsqueeze(1)).sum(0)  # (d,)
    union = code.nonzero().squeeze(-1)  # ascending, and kept so within a group by the stable sort
    columns = union[torch.sort(code[union], stable=True).indices]
    patterns, counts = torch.unique_consecutive(code[columns], return_counts=True)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return columns, starts, ((patterns.unsqueeze(1) >> torch.arange(k)) & 1).to(torch.uint8)


def byte_column_sums(packed: torch.Tensor, width: int, weights: torch.Tensor, dropped: torch.Tensor
                     ) -> torch.Tensor | None:
    """The 8-bit corrections of one position's K heads, sum_{j in D_k} w_j W[:, j] (see ``byte_columns.c``: a
    column that several heads drop is read and multiplied once).

    Args:
        packed: (n_blocks * d, width + 8) uint8, W^T in vocabulary blocks in fbgemm's 8-bit row-wise format
            (:class:`~dropmatch.heads.byte_columns.ByteBlocks`).
        width: vocabulary entries per block.
        weights: (d,) float32, the columns' weights w.
        dropped: (K, d) bool, the heads' dropped columns D_k (K <= 62).

    Returns:
        (K, n_blocks * width) float32, each row within the bound of
        :func:`~dropmatch.heads.byte_columns.byte_correction_bounds`; ``None`` where the kernels do not run here or
        do not take these tensors.
    """
    return _byte_columns(packed, width, weights, dropped)


def byte_column_heads(packed: torch.Tensor, width: int, weights: torch.Tensor, dropped: torch.Tensor,
                      clean: torch.Tensor, keep: float, draft: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, HeadStatistics] | None:
    """:func:`byte_column_sums` turned into the heads ``clean / keep - sums`` with their :func:`head_statistics`, in
    the same pass (each tile of the sums while it is in cache; ``byte_columns.c``): bit for bit
    ``head_statistics(sums[:, :V], draft, clean, keep)`` on the sums, one read of the K heads fewer.

    Args:
        packed, width, weights, dropped: as :func:`byte_column_sums`.
        clean: (V,) float32 dropout-free logits, V <= n_blocks * width.
        keep: 1 - p_drop.
        draft: (V,) float32 draft logits, or ``None``.

    Returns:
        The heads (K, n_blocks * width) float32 (past V: the sums, unchanged) and their statistics over the first V
        tokens; ``None`` where the kernels do not run here or do not take these tensors (also a width that is
        neither a multiple of the statistics' tile nor the whole vocabulary).
    """
    vocab = clean.shape[0] if clean.dim() == 1 else 0
    if not (vocab and _cpu_float32(clean, (vocab,)) and _cpu_float32(draft, (vocab,))):
        return None
    return _byte_columns(packed, width, weights, dropped, clean.contiguous(), keep,
                         None if draft is None else draft.contiguous())


def _byte_columns(packed: torch.Tensor, width: int, weights: torch.Tensor, dropped: torch.Tensor,
                  clean: torch.Tensor | None = None, keep: float = 1.0, draft: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, HeadStatistics] | None:
    """:func:`byte_column_sums` without ``clean``, else :func:`byte_column_heads` (contiguous ``clean`` and ``draft``)."""
    k, d = dropped.shape if dropped.dim() == 2 else (0, 0)
    if not (0 < k <= 62 and d and dropped.dtype == torch.bool and dropped.device.type == "cpu"
            and packed.dim() == 2 and packed.dtype == torch.uint8 and packed.device.type == "cpu"
            and packed.shape[0] % d == 0 and packed.shape[1] == width + 8 and _cpu_float32(weights, (d,))):
        return None
    library = _library()
    if library is None:
        return None
    columns, starts, member = _column_groups(dropped)
    packed, weights = packed.contiguous(), weights.contiguous()
    n_blocks = packed.shape[0] // d
    out = torch.empty(k, n_blocks * width)
    vocab = 0 if clean is None else clean.shape[0]
    centroid, head_max, sums = torch.empty(vocab), torch.empty(vocab), torch.empty(k + 2, dtype=torch.float64)
    status = library.byte_column_sums(packed.data_ptr(), d, width, n_blocks, weights.data_ptr(), columns.data_ptr(),
                                      starts.data_ptr(), member.data_ptr(), member.shape[0], k, out.data_ptr(),
                                      None if clean is None else clean.data_ptr(), keep, vocab,
                                      None if draft is None else draft.data_ptr(), centroid.data_ptr(),
                                      head_max.data_ptr(), sums.data_ptr())
    if status != 0:
        return None
    if clean is None:
        return out
    return out, HeadStatistics(centroid, head_max, sums if draft is not None else sums[:-1])


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` in float32 for a few rows, streaming ``weight`` in its own layout (see
    ``few_rows.c``). Each output row is computed the same way whatever the other rows, so a row's result does
    not depend on how many rows come with it; its error is at most (ceil(k / 8) + 3 + k % 8 + 1) 2^-24
    sum_j |x_j w_j| (+ the bias's rounding) to first order.

    Args:
        x: (m, k) float32 on the CPU.
        weight: (n, k) float32 on the CPU, rows contiguous (a row stride of at least k).
        bias: (n,) float32, or ``None``.
        rows: (r,) int64 indices into ``weight``'s rows, or ``None`` for all: the product on those rows only,
            equal bit for bit to the same columns of the whole product (no gathered copy of the rows).

    Returns:
        (m, n) float32, or (m, r) with ``rows``; ``None`` where the kernels do not run here or do not take these
        tensors. Raises ``IndexError`` for ``rows`` outside ``weight``.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.stride(-1) != 1 or weight.stride(0) < weight.shape[1]:
        return None
    (m, k), n = x.shape, weight.shape[0]
    if not (m and n and k and weight.shape[1] == k and _cpu_float32(x, (m, k))
            and _cpu_float32(weight, (n, k)) and _cpu_float32(bias, (n,))):
        return None
    if rows is not None:
        if not (rows.dim() == 1 and rows.dtype == torch.long and rows.device.type == "cpu"):
            return None
        rows = rows.contiguous()
        lowest, highest = (int(v) for v in torch.aminmax(rows)) if rows.numel() else (0, 0)
        if lowest < 0 or highest >= n:
            raise IndexError(f"few_row_linear: rows must lie in [0, {n}), got [{lowest}, {highest}]")
    library = _library()
    if library is None:
        return None
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    if rows is None:
        out = torch.empty(m, n, dtype=torch.float32)
        library.few_row_linear(x.data_ptr(), m, k, k, weight.data_ptr(), n, weight.stride(0),
                               None if bias is None else bias.data_ptr(), out.data_ptr(), n)
        return out
    out = torch.empty(m, rows.numel(), dtype=torch.float32)
    if rows.numel():
        library.few_row_linear_at(x.data_ptr(), m, k, k, weight.data_ptr(), weight.stride(0), rows.data_ptr(),
                                  rows.numel(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows.numel())
    return out
