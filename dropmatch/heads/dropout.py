"""The K-sample Monte-Carlo-dropout LM head (DropMatch, Sec. 3.1).

Dropout goes on the *input* of the unchanged LM head only: for a last hidden state h (d,),
head i sees h * m_i / (1 - p_drop) with m_i ~ Bernoulli(1 - p_drop)^d. The trunk and the KV cache
run once. Two ways to get the K head logits from the dropout-free logits ``W h`` (V,), and a third
that computes them directly:

* **dense** (the perturbation GEMM): ``W h + W (h * (m_i / (1 - p) - 1))``. The perturbation rows are
  dense, so each head costs one full row of a head GEMM; in bfloat16 they ride in the verification
  GEMM itself (``DropMatch.prefetch``).
* **sparse** (the dropped-column identity): with D_i the dropped coordinates of head i,
  ``W (h * m_i) / (1 - p) = (W h - W[:, D_i] h_{D_i}) / (1 - p)``, so a head costs |D_i| / d of a head
  row: the union U of the dropped columns of the K heads is gathered from a transposed copy of the
  weight (W^T is (d, V), so a column of W is a contiguous row of W^T) and one (K, |U|) x (|U|, V) GEMM
  gives the K corrections (on CPUs: embedding bags over the rows of W^T, which read them in place,
  from a copy of W^T cut into vocabulary blocks; see :func:`shared_column_blocks`). At the equal-noise
  p_drop of a 640-wide model (~0.03) and K = 5, |U| is ~15 % of d.

* **rows** (:attr:`DropoutHead.exact_rows`): on a CPU with oneDNN and a float32 weight,
  ``W (h * m / (1 - p))`` for the K heads of a position directly, a K-row GEMM with the weight reordered
  once for oneDNN's kernels. The pass is bandwidth-bound, so its dtype sets its cost
  (:attr:`DropoutHead.rows_dtype`):

  - float32 (the reference precision, so exact: no error bound): ~26 ms for 5 rows of the embedded
    pair's 262k x 640 head (51-54 ms on a 2-core AVX2 EPYC);
  - bfloat16, where the CPU has native bfloat16 GEMMs (AMX / AVX512-BF16) and bfloat16 heads were asked
    for: half the bytes (13.4 against 25.5 ms on a 2-core AMX Xeon), with each head's rounding bounded
    as the screened head's (:func:`~dropmatch.heads.screened.rounding_bound`), so the decisions are
    certified, or recomputed on float32 rows. ``DropMatch.rows_dtype`` takes them for greedy argmax
    votes only.

  Under greedy decoding with screened clean logits DropMatch takes no pass of its own on a rows head: the
  bfloat16 rows of every position ride in the screened verification GEMM (``DropMatch.fuses``), a few more
  rows of the one bfloat16 pass over the weight, bounded as above (``row_logits`` with ``products``).

**Default on a CPU with oneDNN and a float32 weight:** the sparse path while one position's K heads drop
few columns in expectation (K p_drop <= :data:`SPARSE_FLOAT32_MAX_DROPPED`), else rows. The sparse
corrections are float32 (exact); under greedy decoding, where reduced-precision heads were asked for (the
default), they read W's columns in 8 bits (:attr:`DropoutHead.sparse_dtype`, fbgemm's row-wise format,
:mod:`~dropmatch.heads.byte_columns`) on x86, or, where many columns drop (K p_drop >=
:data:`INT8_GEMM_MIN_DROPPED`), all of W in int8 through oneDNN's int8 GEMM (:mod:`~dropmatch.heads.int8_gemm`,
AMX / AVX512-VNNI), else bfloat16 where the CPU has native bfloat16; their decisions are certified on one
bound per head (see ``DropMatch.corrections_dtype``). Rows never read the clean logits (fused or not); the
sparse heads take the verify step's screened clean logits and certify their decisions.

For a greedy JS decision on one position, :meth:`DropoutHead.summarized_logits` turns the CPU sparse path's sums into
the heads and takes their centroid, maximum and normalizers' sums: with 8-bit columns in the column sums' own pass
(the native :func:`~dropmatch.kernels.byte_column_heads`, each vocabulary tile while it is in cache), else in one
pass after them (:func:`~dropmatch.kernels.head_statistics`), where the kernels build.

Otherwise :attr:`DropoutHead.sparse` picks the path with an explainable rule: sparse when the expected union of
dropped columns of one position's K heads, d (1 - (1 - p)^K), is at most ``sparse_max_fraction`` of d
(default 0.35: the gathered columns are read twice, copied then multiplied, and the dense rows ride
almost free in the verification GEMM). With p_drop = 0 both paths give every head equal to the
dropout-free logits bit for bit (the perturbation, resp. the correction, is exactly zero).

Masks are drawn on the weight's device from a ``torch.Generator`` of that device, seeded from the
step's CPU generator: the same seed gives the same output, but a GPU run and a CPU run draw different
masks (different generator algorithms), so their DropMatch outputs may differ.
"""

from __future__ import annotations

import hashlib
import weakref

import torch
import torch.nn.functional as F

from .. import kernels
from ..errors import ConfigError
from ..onednn_linear import (
    FewRowLinear,
    WeightWatch,
    bf16_matmul_supported,
    memory_key,
    shared_few_row_linear,
    weight_stamp,
)
from .byte_columns import (
    BYTE_ROWWISE,
    BYTE_VOCAB_BLOCK,
    ByteBlocks,
    byte_bag_sums,
    byte_columns_supported,
    byte_correction_bounds,
    shared_byte_blocks,
)
from .int8_gemm import Int8Weight, int8_gemm_supported, int8_product_bounds, int8_products, shared_int8_weight
from .screened import rounding_bound

SPARSE_MAX_FRACTION = 0.35
# CPU float32 default: the sparse path while one position's K heads drop at most this many coordinates
# in expectation (K p_drop, in units of d); its greedy corrections are 8-bit (or bfloat16) where they run,
# and the crossover below was measured in float32. Measured on the embedded pair (262k x 640, 2 cores): the
# flat embedding-bag correction cost ~2 ms + 0.06 ms per dropped column (9.6 ms at K p = 0.19, 19 ms at
# 0.48, 63 ms at 1.5) against 22-28 ms for the exact K-row pass (AVX-512 / AMX EPYC); on the 2-core AVX2
# EPYC of 2026-12-04 the blocked sparse heads take 9.7, 25, 46 and 63 ms at K p = 0.16, 0.5, 1.0 and 1.5
# and the exact K-row pass 51-54 ms (crossover near K p = 1.2 there, near 0.5 on the faster GEMM).
SPARSE_FLOAT32_MAX_DROPPED = 0.5
# CPU sparse path: vocabulary columns per block of the blocked W^T. A K-head correction then accumulates
# into K rows of 64 KB that stay in cache, where whole 1 MB rows (262k vocabulary) went back to memory for
# every dropped column, and the bags (blocks x heads, head-major since 2026-12-06 so that the sums come out
# laid out as the logits) spread over the threads, where K = 5 bags split 3 : 2 on 2 cores. Embedded pair,
# K = 5, p_drop = 0.032, 2-core AVX2 EPYC: the bags take 8.6 against 11.7 ms; in `make bench-dropmatch`
# js+majority's head + rule went from 22.0 to 16.9 ms a position.
VOCAB_BLOCK = 16384
# CPU 8-bit corrections: embedding bags over the dropped columns while a position's K heads drop fewer than this
# many coordinates in expectation (K p_drop, in units of d), else one int8 GEMM over all of W where oneDNN runs
# it (:mod:`~dropmatch.heads.int8_gemm`), whose cost does not depend on p_drop. Embedded pair, K = 5, one
# position, caches flushed, 2-core AMX Xeon (bags against GEMM, ms): 2.4 / 8.6 at K p = 0.16, 8.7 / 8.4 at 0.5,
# 12.4 / 8.6 at 1.0, 16.2 / 8.5 at 1.5, 22.5 / 8.4 at 2.0; bounds 0.06 / 0.08 nats at 0.16, 0.49 / 0.56 at 1.5.
INT8_GEMM_MIN_DROPPED = 0.5

_TRANSPOSED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (weight memory, dtype, block) -> W^T


def shared_column_blocks(weight: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """W^T cut into vocabulary blocks of ``block`` columns, in ``dtype``: (n_blocks * d, width) with
    width = min(block, V), row ``b * d + j`` holding column j of W over the vocabulary block b (the last
    block zero-padded). ``block >= V`` gives W^T itself, (d, V). Built once per weight memory, dtype and
    block (one copy, 671 MB in float32 for the embedded pair) and shared by every dropout head on it while
    one of them holds it; a weight changed in place since (its version, :func:`weight_stamp`) gets a new one."""
    key = (*memory_key(weight), weight_stamp(weight)[0], dtype, block)
    blocks = _TRANSPOSED.get(key)
    if blocks is None:
        vocab, d = weight.shape
        width = min(block, vocab)
        n_blocks = -(-vocab // width)
        blocks = torch.empty((n_blocks, d, width), dtype=dtype, device=weight.device)
        for b in range(n_blocks):
            rows = weight.detach()[b * width : (b + 1) * width]
            blocks[b, :, : rows.shape[0]] = rows.T
            blocks[b, :, rows.shape[0] :] = 0  # padding of the last block
        blocks = _TRANSPOSED[key] = blocks.view(n_blocks * d, width)
    return blocks


def check_dropout_args(k: int, p_drop: float) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"K (number of dropout heads) must be an integer >= 1, got {k!r}")
    if isinstance(p_drop, bool) or not isinstance(p_drop, (int, float)) or not 0.0 <= p_drop < 1.0:
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


def expected_union_fraction(k: int, p_drop: float) -> float:
    """Expected share of the d coordinates dropped by at least one of K heads: 1 - (1 - p)^K."""
    return 1.0 - (1.0 - p_drop) ** k


def mask_seed(generator: torch.Generator, consume: bool = True) -> int:
    """A 63-bit seed from the CPU ``generator`` (reproducible): one draw (``consume``), or a hash of its state,
    leaving its stream untouched (so a rule that draws its masks this way consumes exactly the randomness
    standard verification does)."""
    if consume:
        return int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    digest = hashlib.blake2b(generator.get_state().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class StepMasks:
    """A step's keep-masks (L, K, d), bool, drawn as they are asked for (``masks[a:b]`` gives (b - a, K, d)):
    position j's are the (j + 1)-th (K, d) draw of one generator on ``device`` seeded with ``seed``, so they do
    not depend on which positions are asked for, or in what order, and a step that asks for none draws none. On
    CPUs a position's draw continues the same stream, so they equal one (L, K, d) draw, as the masks were drawn
    before 2026-12-07 (tested); on GPUs (Philox offsets) they differ from that draw, and take one small kernel
    a position."""

    def __init__(self, n_positions: int, k: int, d: int, p_drop: float, seed: int, device: torch.device):
        self.n_positions, self.k, self.d, self.p_drop, self.seed, self.device = n_positions, k, d, p_drop, seed, device
        self._generator: torch.Generator | None = None
        self._masks: torch.Tensor | None = None  # (L, K, d), its first ``_drawn`` positions drawn
        self._drawn = 0

    def __len__(self) -> int:
        return self.n_positions

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, stride = rows.indices(self.n_positions)
        if stride != 1:
            raise ValueError(f"masks are asked for by contiguous positions, got a stride of {stride}")
        if stop <= start:
            return torch.empty((0, self.k, self.d), dtype=torch.bool, device=self.device)
        if self._masks is None:
            self._generator = torch.Generator(device=self.device).manual_seed(self.seed)
            self._masks = torch.empty((self.n_positions, self.k, self.d), dtype=torch.bool, device=self.device)
        for j in range(self._drawn, stop):
            uniform = torch.rand((self.k, self.d), generator=self._generator, device=self.device)
            torch.ge(uniform, self.p_drop, out=self._masks[j])
        self._drawn = max(self._drawn, stop)
        return self._masks[start:stop]  # a view: each position is drawn once and never written again


class DropoutHead:
    """K dropout samples of an LM head.

    Args:
        weight: LM-head weight (V, d), the shared-vocabulary rows.
        k: number of heads K.
        p_drop: dropout probability on the head's input.
        compute_dtype: dtype of the dense perturbation GEMM and of the transposed weight of the sparse
            path; ``None`` picks bfloat16 (float16 for float16 weights). ``torch.float32`` gives
            full-precision heads on both paths.
        softcap: final-logit soft-capping of the model (Gemma-2), or ``None`` (capped heads are
            computed directly: no additive identity holds through tanh).
        weight_in_compute_dtype: ``weight`` already converted, to share one copy (until the weight changes
            in place: the heads then convert their own, see :meth:`drop_stale_copies`).
        sparse: force the sparse (True) or dense (False) path; ``None`` applies the cost rule.
        sparse_max_fraction: the cost rule's threshold on the expected dropped-union fraction.
        vocab_block: vocabulary columns per block of the CPU sparse path's transposed weight; ``None``:
            :data:`VOCAB_BLOCK`, and :data:`~dropmatch.heads.byte_columns.BYTE_VOCAB_BLOCK` for 8-bit columns.
        exact_rows: compute each position's K heads directly with oneDNN's few-row GEMM (the rows path,
            see the module docstring); ``None`` with ``sparse=None``: on a float32 CPU weight with oneDNN,
            rows or sparse heads by K p_drop (sparse ones exact in float32; their greedy corrections see
            ``sparse_dtype``).
        rows_dtype: dtype of the rows path's GEMM; ``None``: bfloat16 where ``compute_dtype`` is bfloat16
            and the CPU has native bfloat16 GEMMs (certified decisions), else the weight's (exact).
        sparse_dtype: dtype of the sparse corrections where decisions are certified on one bound per head
            (greedy, ``DropMatch.corrections_dtype``): a float dtype, or :data:`BYTE_ROWWISE` (8-bit
            row-wise columns, CPU only, see :mod:`~dropmatch.heads.byte_columns`); ``None``: the compute
            dtype, except for the CPU float32 default where a reduced precision was asked for, whose exact
            float32 corrections become 8-bit there where fbgemm runs (x86), else bfloat16 where native.
    """

    def __init__(self, weight: torch.Tensor, k: int = 5, p_drop: float = 0.3,
                 compute_dtype: torch.dtype | None = None, softcap: float | None = None,
                 weight_in_compute_dtype: torch.Tensor | None = None, sparse: bool | None = None,
                 sparse_max_fraction: float = SPARSE_MAX_FRACTION, exact_rows: bool | None = None,
                 vocab_block: int | None = None, rows_dtype: torch.dtype | None = None,
                 sparse_dtype: torch.dtype | None = None):
        check_dropout_args(k, p_drop)
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ConfigError(f"an LM-head weight is a floating-point (V, d) matrix, got {weight.dtype} "
                              f"of shape {tuple(weight.shape)}")
        self.k, self.p_drop, self.softcap, self.vocab_block = k, float(p_drop), softcap, vocab_block
        if compute_dtype is None:
            compute_dtype = torch.float16 if weight.dtype == torch.float16 else torch.bfloat16
        self.compute_dtype = compute_dtype
        self.weight = weight.detach()
        self._weight_c: torch.Tensor | None = weight_in_compute_dtype
        self._weight_t: torch.Tensor | None = None
        self._blocks: dict[torch.dtype, torch.Tensor] = {}  # W^T in vocabulary blocks, per dtype
        self._byte_blocks: ByteBlocks | None = None  # the same in 8 bits (BYTE_ROWWISE corrections)
        self._int8_weight: Int8Weight | None = None  # W in int8 for oneDNN (BYTE_ROWWISE, many dropped columns)
        self._gathered: torch.Tensor | None = None  # rows of W gathered by exact_on, reused
        self._dense_kernel: FewRowLinear | None = None
        self._exact_linear = shared_few_row_linear(weight)  # exact heads on CPU (onednn_linear), one per weight
        if (exact_rows is None and sparse is None and weight.dtype == torch.float32
                and self._exact_linear.supports_weight()):
            # two float32 (exact) paths on CPU: the dropped columns while they are few, else exact rows
            sparse = not softcap and k * self.p_drop <= SPARSE_FLOAT32_MAX_DROPPED
            exact_rows = not sparse
            # exact corrections; greedy ones in 8 bits (else bfloat16 where native), certified (on a rows head:
            # those of greedy JS criteria, which DropMatch computes on sparse heads, see DropMatch.heads_for)
            reduced = self.compute_dtype in (torch.bfloat16, torch.float16)  # a reduced precision was asked for
            native = self.compute_dtype == torch.bfloat16 and bf16_matmul_supported()
            fallback = torch.bfloat16 if native else torch.float32
            sparse_dtype = sparse_dtype or (BYTE_ROWWISE if reduced and byte_columns_supported(weight) else fallback)
            if sparse:
                self.compute_dtype = torch.float32
        self.sparse_dtype = sparse_dtype or self.compute_dtype
        if self.sparse_dtype == BYTE_ROWWISE and not byte_columns_supported(weight):
            raise ConfigError("8-bit row-wise sparse corrections (sparse_dtype=torch.quint8) need a float32 CPU weight "
                              "(their bound is against float32 products) and a torch with fbgemm (x86)")
        self.exact_rows = bool(exact_rows)
        if rows_dtype is None:
            native_bf16 = weight.device.type == "cpu" and bf16_matmul_supported()
            rows_dtype = torch.bfloat16 if self.compute_dtype == torch.bfloat16 and native_bf16 else weight.dtype
        if rows_dtype not in (weight.dtype, torch.bfloat16):
            raise ConfigError(f"rows_dtype must be the weight's dtype ({weight.dtype}) or torch.bfloat16 (certified "
                              f"by its rounding bound), got {rows_dtype}")
        self.rows_dtype = weight.dtype if softcap else rows_dtype  # capped heads: exact (no bound through tanh)
        self._rows_kernel: FewRowLinear | None = None
        if sparse is None:
            sparse = expected_union_fraction(k, self.p_drop) <= sparse_max_fraction
        self.sparse = bool(sparse) and not softcap and not self.exact_rows
        self._norms: tuple[torch.Tensor, torch.Tensor] | None = None
        self._max_rounding = 0.0  # of the second of the norms, set with them
        self._watch = WeightWatch(self.weight)  # the weight as the copies below were derived from it
        self.max_row_norm = self._max_row_norm()

    # -- weights ---------------------------------------------------------------------------------
    def _max_row_norm(self) -> float:
        return float(self.weight.float().norm(dim=1).max()) if self.weight.numel() else 0.0

    def drop_stale_copies(self) -> None:
        """Forget what was derived from the weight (its compute-dtype and transposed copies, their kernels,
        norms) if the weight changed in place since (a checkpoint loaded into the model, a training step:
        :func:`~dropmatch.onednn_linear.weight_stamp`); it is rebuilt on use. :meth:`step_masks` calls it,
        which every step does before computing heads. The heads hold the weight tensor they were given: a
        model whose head weight is replaced (an assigned ``.data`` or Parameter, ``load_state_dict(...,
        assign=True)``) needs new heads (build the method again)."""
        if self._watch.changed(self.weight):
            self._weight_c = self._weight_t = None  # a copy given at construction too
            self._blocks, self._byte_blocks, self._int8_weight = {}, None, None
            self._dense_kernel = self._rows_kernel = None
            self._norms = None
            self.max_row_norm = self._max_row_norm()

    @property
    def weight_c(self) -> torch.Tensor:
        """The weight (V, d) in the compute dtype (converted on first use unless shared)."""
        if self._weight_c is None:
            self._weight_c = self.weight.to(self.compute_dtype)
        return self._weight_c

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (V, d) in ``dtype``: itself, :attr:`weight_c`, or a fresh conversion."""
        if dtype == self.weight.dtype:
            return self.weight
        return self.weight_c if dtype == self.compute_dtype else self.weight.to(dtype)

    @property
    def dense_kernel(self) -> FewRowLinear:
        """``x @ weight_c.T`` for the dense path's perturbation rows (:mod:`~dropmatch.onednn_linear`): oneDNN
        with a reordered copy of :attr:`weight_c` on CPUs (float32, or bfloat16 where native: 7-11 ms for 5-6
        rows of the embedded pair's head against ~19 ms through ``F.linear``), or the native kernel for few
        float32 rows where preferred; ``F.linear`` elsewhere; shared per weight."""
        if self._dense_kernel is None:
            self._dense_kernel = shared_few_row_linear(self.weight_c)
        return self._dense_kernel

    @property
    def weight_t(self) -> torch.Tensor:
        """The transposed weight (d, V), compute dtype, contiguous: column u of W is row u (built once)."""
        if self._weight_t is None:
            self._weight_t = shared_column_blocks(self.weight, self.compute_dtype, self.weight.shape[0])
        return self._weight_t

    @property
    def weight_blocks(self) -> torch.Tensor:
        """W^T in vocabulary blocks (n_blocks * d, width), compute dtype (CPU sparse path)."""
        return self.blocks_in(self.compute_dtype)

    def blocks_in(self, dtype: torch.dtype) -> torch.Tensor:
        """W^T in vocabulary blocks (n_blocks * d, width) in ``dtype`` (built once per dtype, see
        :func:`shared_column_blocks`)."""
        if dtype not in self._blocks:
            self._blocks[dtype] = shared_column_blocks(self.weight, dtype, self.vocab_block or VOCAB_BLOCK)
        return self._blocks[dtype]

    def byte_blocks(self) -> ByteBlocks:
        """W^T in vocabulary blocks in 8 bits a entry (``sparse_dtype`` :data:`BYTE_ROWWISE`; built once, see
        :func:`~dropmatch.heads.byte_columns.shared_byte_blocks`)."""
        if self._byte_blocks is None:
            self._byte_blocks = shared_byte_blocks(self.weight, self.vocab_block or BYTE_VOCAB_BLOCK)
        return self._byte_blocks

    @property
    def corrections_by_gemm(self) -> bool:
        """Whether the 8-bit corrections are one int8 GEMM over all of W (many dropped columns, K p_drop >=
        :data:`INT8_GEMM_MIN_DROPPED`, where oneDNN's int8 GEMM runs) rather than embedding bags over them."""
        return (self.sparse_dtype == BYTE_ROWWISE and self.k * self.p_drop >= INT8_GEMM_MIN_DROPPED
                and int8_gemm_supported())

    def int8_weight(self) -> Int8Weight:
        """W in int8 for oneDNN's int8 GEMM (built once, see :func:`~dropmatch.heads.int8_gemm.shared_int8_weight`)."""
        if self._int8_weight is None:
            self._int8_weight = shared_int8_weight(self.weight)
        return self._int8_weight

    # -- randomness ------------------------------------------------------------------------------
    def step_masks(self, n_positions: int, generator: torch.Generator, consume: bool = True) -> StepMasks:
        """Keep-masks (n_positions, K, d) of one step, drawn on the weight's device as asked (:class:`StepMasks`),
        with a device generator seeded now by :func:`mask_seed` from the step's CPU ``generator`` (one draw, or
        with ``consume=False`` a hash of its state; no host-to-device copy; same seed, same masks; GPU and CPU
        runs draw different masks)."""
        self.drop_stale_copies()
        return StepMasks(n_positions, self.k, self.weight.shape[1], self.p_drop, mask_seed(generator, consume),
                         self.weight.device)

    def draw_masks(self, n_positions: int, generator: torch.Generator, consume: bool = True) -> torch.Tensor:
        """Keep-masks (n_positions, K, d), bool: all of :meth:`step_masks`, drawn now."""
        return self.step_masks(n_positions, generator, consume)[:n_positions]

    # -- dense path ------------------------------------------------------------------------------
    def perturbation_inputs(self, hidden: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Rows (n * K, d) in the compute dtype whose head products are the logit perturbations."""
        delta = hidden.float().unsqueeze(1) * (keep_scale(masks, self.p_drop) - 1.0)  # (n, K, d)
        return delta.reshape(-1, delta.shape[-1]).to(self.compute_dtype)

    def combine(self, clean_logits: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
        """Head logits (n, K, V) float32 from the dropout-free logits (n, V) float32 and the products (n * K, V)
        in the GEMM's dtype (one pass: the sum promotes them)."""
        n = clean_logits.shape[0]
        return torch.add(clean_logits.float().unsqueeze(1), products.view(n, self.k, -1))

    # -- sparse path -----------------------------------------------------------------------------
    def sparse_logits(self, hidden: torch.Tensor, clean_logits: torch.Tensor, masks: torch.Tensor,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
        """Head logits (n, K, V) float32, ``(W h - W[:, D_i] h_{D_i}) / (1 - p)``, from ``hidden`` (n, d), the
        clean logits (n, V) and ``masks`` (n, K, d); the corrections in ``dtype`` on CPUs (default: the
        compute dtype; :data:`BYTE_ROWWISE`: 8-bit columns summed to float32, see
        :mod:`~dropmatch.heads.byte_columns`).

        On CPUs the corrections are embedding bags over the rows of the blocked W^T (no gathered copy), one
        bag per vocabulary block and head; elsewhere one gathered matrix over the union of the dropped
        columns of all n * K heads and one GEMM.
        """
        n, k, d = masks.shape
        dropped = ~masks  # (n, K, d)
        clean = clean_logits.float().unsqueeze(1)  # (n, 1, V)
        if not bool(dropped.any()):  # W h / (1 - p) for every head
            return torch.div(clean.expand(n, k, -1), 1.0 - self.p_drop)
        if hidden.device.type != "cpu":
            union = dropped.reshape(-1, d).any(0).nonzero().squeeze(-1)  # (|U|,)
            coeffs = (hidden.float().unsqueeze(1) * dropped)[..., union].reshape(n * k, -1)  # (n K, |U|)
            columns = self.weight_t.index_select(0, union)  # (|U|, V)
            corrections = torch.mm(coeffs.to(columns.dtype), columns).float().view(n, k, -1)
            return torch.sub(clean, corrections, out=corrections).div_(1.0 - self.p_drop)
        dtype = dtype or self.compute_dtype
        if dtype == BYTE_ROWWISE and self.corrections_by_gemm:  # every column of W, once, for all the heads
            return int8_products(self.int8_weight(), hidden.float().unsqueeze(1) * dropped, -1.0 / (1.0 - self.p_drop),
                                 clean / (1.0 - self.p_drop))
        return self._subtracted(clean, self._bag_sums(hidden, dropped, dtype))

    def _subtracted(self, clean: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """The heads clean / (1 - p) - sums (n, K, V) float32 from the clean logits (n, 1, V) and the bag sums
        (n, K, padded V), in place where the sums are float32."""
        vocab = clean.shape[-1]
        scaled = clean / (1.0 - self.p_drop)
        if sums.shape[-1] != vocab:  # the last block is padded
            scaled = F.pad(scaled, (0, sums.shape[-1] - vocab))
        logits = torch.sub(scaled, sums, out=sums) if sums.dtype == torch.float32 else torch.sub(scaled, sums).float()
        return logits if sums.shape[-1] == vocab else logits[..., :vocab].contiguous()

    def _column_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sparse corrections' weight of each column of W, h / (1 - p): (n, d) float32 from hidden states (n, d).
        The 1 / (1 - p) rides in them, so the heads are one subtraction from the scaled clean logits."""
        return hidden.float() / (1.0 - self.p_drop)

    def _bag_sums(self, hidden: torch.Tensor, dropped: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The CPU sparse path's corrections ``W[:, D_i] h_{D_i} / (1 - p)`` (n, K, n_blocks * width), float32
        (``dtype``'s for bfloat16 columns): embedding bags over the rows of the blocked W^T, one bag per head and
        vocabulary block, laid out as the logits (the vocabulary zero-padded to whole blocks). 8-bit columns go
        through the native :func:`~dropmatch.kernels.byte_column_sums` where it runs (each position's heads
        together, a column read once), else fbgemm's bags; both within
        :func:`~dropmatch.heads.byte_columns.byte_correction_bounds`."""
        n, k, d = dropped.shape
        column_weights = self._column_weights(hidden)
        if dtype == BYTE_ROWWISE:
            blocks = self.byte_blocks()
            n_blocks, width = blocks.packed.shape[0] // d, blocks.width
            # natively, each position's heads at once (a column several heads drop is read once; bounded as the bags)
            sums = [kernels.byte_column_sums(blocks.packed, width, column_weights[i], dropped[i]) for i in range(n)]
            if all(s is not None for s in sums):
                return torch.stack(sums) if n > 1 else sums[0].unsqueeze(0)
        else:
            blocks = self.blocks_in(dtype)
            n_blocks, width = blocks.shape[0] // d, blocks.shape[1]
        bags = dropped.reshape(n * k, d)
        bag, column = bags.nonzero(as_tuple=True)  # ordered by bag (position i * K + head)
        sizes = bags.sum(1)
        starts = sizes.cumsum(0) - sizes
        # one bag per head and vocabulary block, head-major, so the sums come out laid out as the logits:
        # entry e of head h goes to bag (h, b) at starts[h] * n_blocks + b * sizes[h] + its rank in h
        block = torch.arange(n_blocks, device=hidden.device).unsqueeze(1)  # (n_blocks, 1)
        rank = torch.arange(column.numel(), device=hidden.device) - starts[bag]
        place = ((starts[bag] * n_blocks + rank) + block * sizes[bag]).reshape(-1)
        indices = torch.empty_like(place).index_copy_(0, place, (block * d + column).reshape(-1))
        offsets = (starts.unsqueeze(1) * n_blocks + block.T * sizes.unsqueeze(1)).reshape(-1)
        weights = column_weights[bag // k, column]
        weights = weights.new_empty(place.numel()).index_copy_(0, place, weights.repeat(n_blocks))
        if dtype == BYTE_ROWWISE:
            sums = byte_bag_sums(blocks, indices, offsets, weights)  # (n K n_blocks, width) float32
        else:
            sums = F.embedding_bag(indices, blocks, offsets, mode="sum", per_sample_weights=weights.to(blocks.dtype))
        return sums.view(n, k, n_blocks * width)

    def summarized_logits(self, hidden: torch.Tensor, clean_logits: torch.Tensor, masks: torch.Tensor,
                          sparse_dtype: torch.dtype | None = None, draft_logits: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, kernels.HeadStatistics | None]:
        """:meth:`logits` of one position (1, K, V), with the K heads' :class:`~dropmatch.kernels.HeadStatistics`
        (centroid, maximum, exponential sums, and those of ``draft_logits`` (V,) if given) where the CPU sparse
        path's sums are turned into the heads natively: with 8-bit columns in the same pass as the sums
        (:func:`~dropmatch.kernels.byte_column_heads`; a random 262k x 640 weight, K = 5, p_drop 0.032, caches
        flushed, 2-core AVX2 EPYC, seven runs: 0.02-0.36 ms less than the sums and then the statistics, 4.4-5.9 ms),
        else by :func:`~dropmatch.kernels.head_statistics` after them (the subtraction and the statistics in one pass,
        where torch takes several); a greedy JS decision reads them. Else ``None`` beside the same logits."""
        dtype = sparse_dtype or self.compute_dtype
        dropped = ~masks
        if (self.softcap or not self.sparse or hidden.shape[0] != 1 or hidden.device.type != "cpu"
                or dtype not in (BYTE_ROWWISE, torch.float32) or (dtype == BYTE_ROWWISE and self.corrections_by_gemm)
                or not bool(dropped.any()) or not kernels.available()):
            return self.logits(hidden, clean_logits, masks, sparse_dtype=sparse_dtype), None
        vocab, clean = clean_logits.shape[-1], clean_logits[0].float()
        fused = None
        if dtype == BYTE_ROWWISE:  # natively, the heads and their statistics in the column sums' own pass
            blocks = self.byte_blocks()
            fused = kernels.byte_column_heads(blocks.packed, blocks.width, self._column_weights(hidden)[0],
                                              dropped[0], clean, 1.0 - self.p_drop, draft_logits)
        if fused is not None:
            sums, statistics = fused[0].unsqueeze(0), fused[1]  # (1, K, padded V): the heads already
        else:  # the sums, then the heads and their statistics in one pass
            sums = self._bag_sums(hidden, dropped, dtype)  # (1, K, padded V) float32
            statistics = kernels.head_statistics(sums[0, :, :vocab], draft_logits, clean, 1.0 - self.p_drop)
            if statistics is None:
                return self._subtracted(clean.unsqueeze(0).unsqueeze(1), sums), None
        return (sums if sums.shape[-1] == vocab else sums[..., :vocab].contiguous()), statistics

    # -- heads -----------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor, clean_logits: torch.Tensor, masks: torch.Tensor,
               products: torch.Tensor | None = None, sparse_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Head logits (n, K, V) float32.

        Args:
            hidden: last hidden states (n, d).
            clean_logits: dropout-free logits (n, V) float32 (after soft-capping if any).
            masks: keep-masks (n, K, d) from :meth:`draw_masks`.
            products: ``W @ perturbation_inputs(hidden, masks).T`` if already computed (e.g. fused
                into the verification GEMM): the dense path is then taken whatever :attr:`sparse` says.
            sparse_dtype: the sparse corrections' dtype (default: the compute dtype).
        """
        if self.softcap:  # capped logits are not additive in the perturbation: compute directly
            return self.exact_logits(hidden, masks)
        if products is not None:
            return self.combine(clean_logits, products)
        if self.sparse:
            return self.sparse_logits(hidden, clean_logits, masks, sparse_dtype)
        return self.combine(clean_logits, self.dense_kernel(self.perturbation_inputs(hidden, masks)))

    def exact_logits(self, hidden: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Head logits (n, K, V) in the weight's own precision, ``W (h * m / (1 - p))`` (soft-capped if any)."""
        rows = dropout_inputs(hidden, masks, self.p_drop).to(self.weight.dtype)
        raw = self._exact_linear(rows.reshape(-1, rows.shape[-1])).float().view(*rows.shape[:-1], -1)
        return torch.tanh(raw / self.softcap) * self.softcap if self.softcap else raw

    def row_inputs(self, hidden: torch.Tensor, masks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows path's GEMM rows (n * K, d) in ``dtype``: each head's input h * m / (1 - p)."""
        rows = dropout_inputs(hidden, masks, self.p_drop)
        return rows.reshape(-1, rows.shape[-1]).to(dtype)

    def row_logits(self, hidden: torch.Tensor, masks: torch.Tensor, dtype: torch.dtype | None = None,
                   products: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows path: head logits (n, K, V) float32 from a K-row GEMM in ``dtype`` (default
        :attr:`rows_dtype`), and bounds (n, K) in nats on each head's error against :meth:`exact_logits`:
        zero in the weight's precision; in bfloat16 the screened head's rounding bound (inputs rounded to
        bfloat16, float32 accumulation, output rounded). ``products``: that GEMM's output (n * K, V) for
        :meth:`row_inputs` already at hand (e.g. from the verification GEMM, bfloat16 with the same rounding);
        their own dtype is then the GEMM's, whatever ``dtype`` says."""
        dtype = products.dtype if products is not None else dtype or self.rows_dtype
        if self.softcap or (dtype == self.weight.dtype and products is None):  # capped: exact (no bound through tanh)
            logits = self.exact_logits(hidden, masks)
            return logits, torch.zeros(logits.shape[:2], device=logits.device)
        rows = dropout_inputs(hidden, masks, self.p_drop)  # (n, K, d) float32
        if products is None:
            if self._rows_kernel is None or self._rows_kernel.weight.dtype != dtype:
                self._rows_kernel = shared_few_row_linear(self.weight_in(dtype))
            products = self._rows_kernel(rows.reshape(-1, rows.shape[-1]).to(dtype))
        logits = products.float().view(*rows.shape[:-1], -1)
        magnitude = torch.maximum(logits.amax(-1), -logits.amin(-1))  # max |logit|, without a (n, K, V) |.|
        bounds = rounding_bound(dtype, self.weight.shape[1], self.max_row_norm, rows.norm(dim=-1), magnitude)
        return logits, bounds

    def exact_on(self, hidden: torch.Tensor, masks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Exact head logits (n, K, |tokens|) on a token subset (soft-capped if any): by the native few-row kernel
        on those rows of W where it serves the exact heads (bit for bit :meth:`exact_logits`' values where that
        takes the kernel too: n K <= 16 rows; 1.1k tokens of the embedded pair ~0.2 against ~0.45 ms by a gather
        and a GEMM, 7k ~1 against ~6 ms, 2-core AVX2 EPYC), else rows of W gathered, in the weight's precision,
        into a buffer kept for the next gather (a fresh one of 10-80 MB is fresh pages from the OS, which the
        gather then faults in, ~2 ms for 4k rows of the embedded pair against ~1 ms)."""
        inputs = dropout_inputs(hidden, masks, self.p_drop).to(self.weight.dtype)
        raw = self._exact_linear.native_at(inputs, tokens)
        if raw is None:
            if (self._gathered is None or self._gathered.shape[0] < tokens.numel()
                    or self._gathered.is_inference() != torch.is_inference_mode_enabled()):  # written in place below
                self._gathered = self.weight.new_empty((max(tokens.numel(), 4096), self.weight.shape[1]))
            rows = torch.index_select(self.weight, 0, tokens, out=self._gathered[: tokens.numel()])
            raw = F.linear(inputs, rows).float()
        return torch.tanh(raw / self.softcap) * self.softcap if self.softcap else raw

    def row_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(||W_v||, ||W_v - bf16(W_v)||) per vocabulary row (V,) float32, computed once (in chunks)."""
        if self._norms is None:
            norms, rounding = [], []
            for chunk in self.weight.split(32768):
                w = chunk.float()
                norms.append(w.norm(dim=1))
                rounding.append((w - w.to(torch.bfloat16).float()).norm(dim=1))
            self._norms = (torch.cat(norms), torch.cat(rounding))
            self._max_rounding = float(self._norms[1].max())
        return self._norms

    def screened_clean_bounds(self, hidden: torch.Tensor, clean_logits: torch.Tensor) -> torch.Tensor:
        """Per-token bounds (n, V), in nats, on the error of clean logits from a bfloat16 GEMM with float32
        accumulation and bfloat16 output (the screened head's) over ``hidden`` (n, d).

        With h~ = bf16(h), W~ = bf16(W) and y~ the output: |y~_v - W_v h| <= ||W~_v - W_v|| ||h~||
        + ||W_v|| ||h~ - h|| (input rounding, Cauchy-Schwarz with the rounding errors measured, not assumed
        at their worst) + 2 d 2^-24 ||W~_v|| ||h~|| (accumulation) + u / (1 - u) |y~_v| (output rounding),
        times 1.05 for slack. Tokens the screened head recomputed in float32 are bounded too (conservative).
        """
        norms, rounding = self.row_norms()
        return self._screened_bound(hidden, norms, rounding, clean_logits.float().abs())

    def screened_clean_bound_max(self, hidden: torch.Tensor, clean_logits: torch.Tensor) -> torch.Tensor:
        """A bound (n, 1), in nats, on every token's entry of :meth:`screened_clean_bounds` (each of its
        terms at its maximum over the vocabulary): one pass over the logits, where the per-token bounds take
        several."""
        self.row_norms()  # their maxima: self.max_row_norm, self._max_rounding
        clean = clean_logits.float()  # two reductions: torch.aminmax along a dim is ~15x slower on CPUs (0.41 ms, 262k)
        magnitude = torch.maximum(clean.amax(-1, keepdim=True), -clean.amin(-1, keepdim=True))
        return self._screened_bound(hidden, self.max_row_norm, self._max_rounding, magnitude)

    def _screened_bound(self, hidden: torch.Tensor, norms: torch.Tensor | float, rounding: torch.Tensor | float,
                        magnitude: torch.Tensor) -> torch.Tensor:
        """The bound of :meth:`screened_clean_bounds` from row norms ||W_v||, their bfloat16 rounding
        ||W~_v - W_v|| and output magnitudes |y~_v|, per token (V,) or one number each, broadcast against
        the rows (n, 1) of ``hidden`` (n, d)."""
        h = hidden.float()
        h_b = h.to(torch.bfloat16).float()
        hb_norm, dh_norm = h_b.norm(dim=-1, keepdim=True), (h_b - h).norm(dim=-1, keepdim=True)  # (n, 1)
        u, d = 2.0**-8, self.weight.shape[1]
        inputs = rounding * hb_norm + norms * dh_norm + 2 * d * 2.0**-24 * (1 + u) * norms * hb_norm
        return 1.05 * inputs + 1.05 * u / (1 - u) * magnitude

    def error_scale(self, fused: bool) -> float:
        """Factor from the clean logits' error to the head logits' (sparse: (W h - ...) / (1 - p))."""
        return 1.0 if (fused or not self.sparse) else 1.0 / (1.0 - self.p_drop)

    def product_bounds(self, hidden: torch.Tensor, masks: torch.Tensor, clean_logits: torch.Tensor,
                       head_logits: torch.Tensor, fused: bool, read_outputs: bool = True,
                       sparse_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Bounds (n, K), in nats, on the rounding of the compute-dtype product in :meth:`logits`, before
        :meth:`error_scale` (dense: the perturbation rows; sparse: the gathered columns; 8-bit columns: their
        measured quantization, the float32 sums and the subtraction from the clean logits, without reading the
        outputs); a float32 product counts as exact (the reference precision). A head logit's error is at most
        ``error_scale(fused) * (clean error + product bound)``.

        Args:
            hidden, masks: (n, d) and (n, K, d) as for :meth:`logits`.
            clean_logits, head_logits: (n, V) and (n, K, V), the inputs and outputs of :meth:`logits`.
            fused: whether the dense products came from the verification GEMM (dense path).
            read_outputs: bound the output rounding by the products' largest magnitude, read back from the
                heads (several passes over them); ``False``: by max_v ||W_v|| ||x|| (Cauchy-Schwarz, no pass;
                ~20x the products here, which adds about half the input rounding's bound).
            sparse_dtype: the sparse corrections' dtype, as given to :meth:`logits`.
        """
        dense = fused or not self.sparse
        dtype = self.compute_dtype if dense else sparse_dtype or self.compute_dtype
        if self.softcap or dtype in (torch.float32, torch.float64):  # exact: weight precision or float32
            return torch.zeros(head_logits.shape[:2], device=hidden.device)
        if dtype == BYTE_ROWWISE:  # measured quantization, float32 sums, and clean / (1 - p) - sums (two roundings,
            # |clean| + |correction| <= 2 max ||W_v|| ||h||: 3 u against the 4 u allowed); zero where nothing drops
            dropped = ~masks
            subtraction = 2.0**-22 * self.max_row_norm * hidden.float().norm(dim=-1, keepdim=True)
            if self.corrections_by_gemm:  # the clean logits added in two steps: twice the subtraction's roundings
                inputs = hidden.float().unsqueeze(1) * dropped
                bounds = int8_product_bounds(self.int8_weight(), inputs) + 2 * subtraction
            else:
                bounds = byte_correction_bounds(self.byte_blocks(), hidden, dropped) + subtraction
            return torch.where(dropped.any(-1), bounds, 0.0)
        h = hidden.float().unsqueeze(1)
        x_norm = (h * (keep_scale(masks, self.p_drop) - 1.0) if dense else h * ~masks).norm(dim=-1)  # (n, K): ||delta||, ||h_D||
        d = self.weight.shape[1]
        if not read_outputs:  # |computed| <= (1 + u) (|exact| + input rounding), u <= 2^-8; |exact| <= max ||W_v|| ||x||
            reach = self.max_row_norm * x_norm
            magnitude = 1.01 * (reach + rounding_bound(dtype, d, self.max_row_norm, x_norm, torch.zeros(())))
        else:
            # The output rounding is relative to the products themselves (W delta, W[:, D] h_D), read back
            # from the heads (+ the float32 rounding of that read-back). A zero input gives exactly zero
            # products and no bound: at p_drop = 0 the heads are the clean logits, decided on as standard
            # verification decides.
            clean = clean_logits.float().unsqueeze(1)  # (n, 1, V)
            products = head_logits - clean if dense else clean - (1.0 - self.p_drop) * head_logits
            readback = 4 * 2.0**-23 * (clean.abs().amax(-1) + head_logits.abs().amax(-1))
            magnitude = torch.where(x_norm > 0, products.abs().amax(-1) + readback, 0.0)
        return rounding_bound(dtype, d, self.max_row_norm, x_norm, magnitude)
