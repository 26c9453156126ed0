"""Dropout heads against an independent dense computation: sparse and dense paths, exactness on
screened (inexact) clean logits, and sampling votes that reduce to speculative sampling at p_drop = 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dropmatch import kernels, onednn_linear
from dropmatch.errors import ConfigError
from dropmatch.heads.byte_columns import BYTE_ROWWISE, byte_bags_supported
from dropmatch.heads.dropout import SPARSE_FLOAT32_MAX_DROPPED, DropoutHead
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.onednn_linear import bf16_matmul_supported, onednn_linear_supported
from dropmatch.rules import RelaxedVerification, VerifyInput
from dropmatch.rules.dropmatch import CRITERIA, DropMatch
from dropmatch.sampling import SamplingConfig

from .conftest import random_prompt, screened_heads

GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(0.8, 1.0)


def _js64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = 0.5 * (a + b)
    kl = lambda p: torch.where(p > 0, p * (p.log() - m.log()), torch.zeros_like(p)).sum(-1)  # noqa: E731
    return 0.5 * (kl(a) + kl(b))


def dense_reference(criterion: str, weight: torch.Tensor, inp: VerifyInput, masks: torch.Tensor, p: float,
                    seed: int) -> tuple[int, int]:
    """(accepted, extra accepts) from heads F.linear(h * m / (1 - p), W) in float64, written apart
    from the package: greedy exact match / speculative sampling, then the criterion where it rejects."""
    return dense_reference_with_evaluations(criterion, weight, inp, masks, p, seed)[:2]


def dense_reference_with_evaluations(criterion: str, weight: torch.Tensor, inp: VerifyInput, masks: torch.Tensor,
                                     p: float, seed: int) -> tuple[int, int, int]:
    """:func:`dense_reference` and the positions a lazy rule must evaluate the criterion at: those the
    standard rule rejects, up to the first one the criterion rejects too."""
    w = weight.double()
    n = inp.n_draft
    exact_clean = F.linear(inp.hidden.double(), w)
    gen = torch.Generator().manual_seed(seed)
    sampling = inp.sampling
    if sampling.greedy:
        torch.randint(0, 2**63 - 1, (1,), generator=gen)  # the mask generator's seed draw
    if sampling.greedy:
        standard = (inp.draft_tokens == exact_clean[:n].argmax(-1)).tolist()
        temp = 1.0
    else:
        u = torch.rand(n + 1, generator=gen)
        temp = sampling.temperature
        pt = torch.softmax(exact_clean / temp, -1)
        q_x = [float(inp.draft_probs[j, inp.draft_tokens[j]]) for j in range(n)]
        standard = [bool(u[j] * q_x[j] < pt[j, inp.draft_tokens[j]]) for j in range(n)]
    decisions = []
    for j in range(n):
        x = int(inp.draft_tokens[j])
        heads = F.linear(inp.hidden[j].double() * masks[j].double() / (1 - p), w)  # (K, V)
        probs = torch.softmax(heads / temp, -1)
        votes = heads.argmax(-1) == x if sampling.greedy else probs[:, x] > float(u[j]) * q_x[j]
        k = heads.shape[0]
        naive, majority = bool(votes.any()), 2 * int(votes.sum()) > k
        centroid = torch.softmax(heads.mean(0) / temp, -1)
        q = inp.draft_distribution(j).double()
        js = bool(_js64(q, centroid) <= _js64(probs, centroid).max())
        decisions.append({"naive": naive, "majority": majority, "js": js, "js+majority": js or majority}[criterion])
    for j in range(n):
        if not (standard[j] or decisions[j]):
            extra = sum(1 for i in range(j) if not standard[i])
            return j, extra, extra + 1
    extra = sum(1 for s in standard if not s)
    return n, extra, extra


def random_case(seed: int, sampling: SamplingConfig, vocab: int = 60, d: int = 24, n_draft: int = 5):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, d, generator=g) * 0.5
    hidden = torch.randn(n_draft + 1, d, generator=g)
    logits = F.linear(hidden, weight)
    draft = logits[:n_draft].argmax(-1)
    flip = torch.rand(n_draft, generator=g) < 0.6  # most positions are near-misses
    draft = torch.where(flip, logits[:n_draft].topk(3, -1).indices[:, 1 + seed % 2], draft)
    q = sampling.probs(0.5 * torch.randn(n_draft, vocab, generator=g) + logits[:n_draft])
    if not sampling.greedy:
        return weight, VerifyInput(draft, q, logits, hidden, sampling, g)
    return weight, VerifyInput(draft, None, logits, hidden, sampling, g, draft_logits=q.log())


def _with(inp: VerifyInput, seed: int, logits: torch.Tensor | None = None) -> VerifyInput:
    return VerifyInput(inp.draft_tokens, inp.draft_probs, inp.target_logits if logits is None else logits, inp.hidden,
                       inp.sampling, torch.Generator().manual_seed(seed), inp.draft_logits,
                       logits_screened=logits is not None)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


def _on(inp: VerifyInput, device: str) -> VerifyInput:
    """The step's tensors on ``device`` (its generator stays the step's CPU generator)."""
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return VerifyInput(move(inp.draft_tokens), move(inp.draft_probs), move(inp.target_logits), move(inp.hidden),
                       inp.sampling, inp.generator, move(inp.draft_logits))


DEFAULT_PATH = {"compute_dtype": None}


def _paths(device: str) -> list[dict]:
    """The head paths to check on ``device``: float32 sparse and dense products, the default (CPUs with
    oneDNN: sparse heads, exact in float32 with greedy corrections in 8 bits on x86, or rows; elsewhere
    bfloat16 products with certified decisions), rows in
    float32 where oneDNN runs and in bfloat16 (certified: greedy argmax votes take them), and on CUDA the
    bfloat16 sparse and dense paths forced."""
    paths = [{"sparse": True}, {"sparse": False}, DEFAULT_PATH]
    if device == "cpu":  # + the sparse path's blocked W^T in several blocks, the last one padded (V = 60)
        rows = [{"exact_rows": True}, {"exact_rows": True, "rows_dtype": torch.bfloat16}]
        return paths + [{"sparse": True, "vocab_block": 16}] + (rows if onednn_linear_supported() else [])
    return paths + [{"sparse": True, "compute_dtype": None}, {"sparse": False, "compute_dtype": None}]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("p_drop", [0.0, 0.03, 0.3])
@pytest.mark.parametrize("criterion", CRITERIA)
def test_sparse_and_dense_paths_equal_dense_float64(criterion, p_drop, sampling, device):
    """The head paths on each device (sparse and dense with float32 or, certified, bfloat16 products;
    exact rows where oneDNN runs) take the decisions of an independent float64 dense computation on
    the CPU over the same masks (drawn on the device), evaluating the criterion only where needed;
    and they accept beyond the standard rule at p > 0."""
    extra = skipped = 0
    for seed in range(40):
        weight, inp = random_case(seed, sampling)
        weight_on = weight.to(device)
        masks = DropoutHead(weight_on, k=5, p_drop=p_drop).draw_masks(
            inp.n_draft, torch.Generator().manual_seed(seed), consume=sampling.greedy)
        assert masks.device.type == device
        accepted, extra_expected, evaluations = dense_reference_with_evaluations(
            criterion, weight, inp, masks.cpu(), p_drop, seed)
        for path in _paths(device):
            head = DropoutHead(weight_on, k=5, p_drop=p_drop, **({"compute_dtype": torch.float32} | path))
            if path == DEFAULT_PATH and device == "cpu":  # on CPUs with oneDNN, one of the two float32 paths by K p_drop
                assert head.exact_rows == (onednn_linear_supported() and 5 * p_drop > SPARSE_FLOAT32_MAX_DROPPED)
            verdict = RelaxedVerification(DropMatch(head, criterion)).verify(_with(_on(inp, device), seed))
            assert (verdict.n_accepted, verdict.extra_accepts) == (accepted, extra_expected), (seed, path)
            assert verdict.criterion_evaluations == evaluations, (seed, path)  # lazily: only where needed
            extra += verdict.extra_accepts
            skipped += 5 - evaluations
    assert skipped > 0  # some positions were never evaluated
    if p_drop == 0.0:
        assert extra == 0  # p_drop = 0 is standard verification, greedy and sampled
    elif p_drop == 0.3:
        assert extra > 0


def test_bfloat16_rows_hold_their_bounds_and_certify_most_votes():
    """Rows computed in bfloat16 are within their bounds of the float64 heads (every head, every token),
    the bounds are tight enough that greedy argmax votes certify without the float32 pass at most
    positions, and the decisions are those of float32 rows."""
    evaluations = fallbacks = refined = 0
    for seed in range(30):
        weight, inp = random_case(seed, GREEDY, vocab=400, d=64)
        head = DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.bfloat16)
        masks = head.draw_masks(inp.n_draft, torch.Generator().manual_seed(seed))
        logits, bounds = head.row_logits(inp.hidden[:-1], masks)
        exact = torch.einsum("vd,nkd->nkv", weight.double(), inp.hidden[:-1].double().unsqueeze(1) * masks / 0.7)
        assert bool((bounds > 0).all())
        assert bool(((logits.double() - exact).abs() <= bounds.unsqueeze(-1).double()).all()), seed
        exact_head = DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.float32)
        for criterion in ("naive", "majority"):
            rule = DropMatch(head, criterion)
            verdict = RelaxedVerification(rule).verify(_with(inp, seed))
            expected = RelaxedVerification(DropMatch(exact_head, criterion)).verify(_with(inp, seed))
            assert (verdict.n_accepted, verdict.extra_accepts) == (expected.n_accepted, expected.extra_accepts)
            evaluations += rule.counters.evaluations
            fallbacks += rule.counters.exact_fallbacks
            refined += rule.counters.refined_tokens
    assert evaluations > 50 and fallbacks < 0.2 * evaluations
    assert refined > 0  # the votes were certified on bfloat16 rows, not computed on float32 ones
    with pytest.raises(ConfigError, match="rows_dtype"):
        DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.float16)


FALLBACK_RATE = 0.2
SCREENED_PATHS = [{"compute_dtype": torch.bfloat16, "sparse": True}, {"compute_dtype": torch.bfloat16, "sparse": False}]
if byte_bags_supported():  # 8-bit columns for the greedy corrections
    SCREENED_PATHS.append({"compute_dtype": torch.float32, "sparse": True, "sparse_dtype": BYTE_ROWWISE})


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("p_drop", [0.0, 0.03, 0.3])
def test_screened_inexact_clean_logits_give_exact_decisions(criterion, p_drop):
    """Greedy clean logits off by up to the screened bound (bf16 GEMM, exact only near the top) and
    bf16 products or 8-bit corrections still give the exact decisions: certified, or recomputed exactly."""
    from dropmatch.heads.screened import ScreenedHead

    fallbacks, evaluations = [0] * len(SCREENED_PATHS), [0] * len(SCREENED_PATHS)
    for seed in range(40):
        weight, inp = random_case(seed, GREEDY, vocab=400, d=32)
        screened = ScreenedHead(weight, refine_margin=0.5)(inp.hidden)
        assert not torch.equal(screened, inp.target_logits)  # really inexact
        masks = DropoutHead(weight, k=5, p_drop=p_drop).draw_masks(inp.n_draft, torch.Generator().manual_seed(seed))
        expected = dense_reference(criterion, weight, inp, masks, p_drop, seed)
        for i, path in enumerate(SCREENED_PATHS):
            dm = DropMatch(DropoutHead(weight, k=5, p_drop=p_drop, **path), criterion)
            verdict = RelaxedVerification(dm).verify(_with(inp, seed, screened))
            assert (verdict.n_accepted, verdict.extra_accepts) == expected, (seed, path)
            fallbacks[i] += dm.counters.exact_fallbacks
            evaluations[i] += dm.counters.evaluations
            # the inexact heads went through certification (at p_drop = 0 none are computed: every head is
            # the target, and the rule rejects what standard verification rejects)
            assert p_drop == 0 or dm.counters.refined_tokens > 0 or verdict.criterion_evaluations == 0
    for path, fell_back, evaluated in zip(SCREENED_PATHS, fallbacks, evaluations, strict=True):
        assert fell_back <= FALLBACK_RATE * evaluated, path  # the bounds certify most decisions on each path


@pytest.mark.parametrize("sparse,vocab_block", [(True, None), (True, 64), (False, None)],
                         ids=["sparse", "sparse-padded-blocks", "dense"])
def test_bfloat16_product_bounds_hold_and_vanish_at_p_drop_zero(sparse, vocab_block):
    """The bound on the bf16 products covers their error against float64 heads; at p_drop = 0 the products
    are exactly zero, so the bound is zero and DropMatch decides on the clean logits as they are (no token
    recomputed by another kernel), as standard verification does."""
    g = torch.Generator().manual_seed(5)
    weight, hidden = torch.randn(300, 48, generator=g) * 0.5, torch.randn(4, 48, generator=g) * 3
    clean = F.linear(hidden, weight)  # float32: the reference precision
    for p in (0.0, 0.03, 0.3):
        head = DropoutHead(weight, k=5, p_drop=p, compute_dtype=torch.bfloat16, sparse=sparse, exact_rows=False,
                           vocab_block=vocab_block)
        masks = head.draw_masks(4, g)
        logits = head.logits(hidden, clean, masks)
        exact = F.linear(hidden.double().unsqueeze(1) * masks / (1 - p), weight.double())
        for read_outputs in (True, False):  # the output rounding from the products read back, or Cauchy-Schwarz
            bound = head.error_scale(False) * head.product_bounds(hidden, masks, clean, logits, fused=False,
                                                                  read_outputs=read_outputs)
            assert ((logits.double() - exact).abs().amax(-1) <= bound.double() + 1e-4).all()
            assert (bound == 0).all() == (p == 0.0)
    for seed in range(10):
        weight, inp = random_case(seed, GREEDY, vocab=400, d=32)
        dm = DropMatch(DropoutHead(weight, k=5, p_drop=0.0, compute_dtype=torch.bfloat16, sparse=sparse,
                                   exact_rows=False), "js+majority")
        verdict = RelaxedVerification(dm).verify(_with(inp, seed))
        assert verdict.extra_accepts == 0 and dm.counters.refined_tokens == 0


@pytest.mark.parametrize("vocab_block", [500, 64, 100], ids=["one-block", "padded-blocks", "exact-blocks"])
def test_sparse_logits_match_dense_definition(vocab_block):
    """Sparse heads equal W (h m) / (1 - p), with W^T in one vocabulary block (500 tokens), in blocks whose
    last one is padded (7 x 64 + 52) or in blocks that tile it (5 x 100); bit for bit at p_drop = 0 (clean
    logits) and where no column drops (W h / (1 - p))."""
    g = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(500, 40, generator=g), torch.randn(3, 40, generator=g)
    clean = F.linear(hidden, weight)
    for p in (0.0, 0.03, 0.3):
        head = DropoutHead(weight, k=5, p_drop=p, compute_dtype=torch.float32, sparse=True, vocab_block=vocab_block)
        masks = head.draw_masks(3, g)
        expected = F.linear(hidden.double().unsqueeze(1) * masks / (1 - p), weight.double())
        torch.testing.assert_close(head.logits(hidden, clean, masks).double(), expected, atol=1e-4, rtol=1e-4)
        if p == 0.0:
            assert torch.equal(head.logits(hidden, clean, masks), clean.unsqueeze(1).expand(-1, 5, -1))
    keep_all = torch.ones(3, 5, 40, dtype=torch.bool)
    assert torch.equal(head.logits(hidden, clean, keep_all), (clean / 0.7).unsqueeze(1).expand(-1, 5, -1))
    assert head.weight_blocks.shape == (-(-500 // vocab_block) * 40, vocab_block)


def test_cost_rule_picks_sparse_at_small_p_and_masks_on_device():
    w = torch.randn(100, 640)
    assert DropoutHead(w, k=5, p_drop=0.032, exact_rows=False).sparse
    assert not DropoutHead(w, k=5, p_drop=0.3, exact_rows=False).sparse
    if onednn_linear_supported():  # CPU float32: sparse heads while few columns drop, else exact rows
        few = DropoutHead(w, k=5, p_drop=0.032, compute_dtype=torch.bfloat16)
        # exact float32 corrections (sampling), greedy ones in 8 bits (certified) on x86, else bfloat16 where native
        assert few.sparse and not few.exact_rows and few.compute_dtype == torch.float32
        reduced = torch.bfloat16 if bf16_matmul_supported() else torch.float32
        assert few.sparse_dtype == (BYTE_ROWWISE if byte_bags_supported() else reduced)
        asked_exact = DropoutHead(w, k=5, p_drop=0.032, compute_dtype=torch.float32)
        assert asked_exact.sparse and asked_exact.sparse_dtype == torch.float32  # float32 asked: exact corrections
        assert DropMatch(few).corrections_dtype(SamplingConfig(0.8, 1.0)) == torch.float32
        assert DropMatch(few).corrections_dtype(SamplingConfig()) == few.sparse_dtype
        many = DropoutHead(w, k=5, p_drop=0.3)
        assert many.exact_rows and not many.sparse
    assert not DropoutHead(w.bfloat16(), k=5, p_drop=0.032).exact_rows
    assert not DropoutHead(w, k=5, p_drop=0.032, sparse=True).exact_rows  # a forced path is kept
    head = DropoutHead(w, k=5, p_drop=0.3)
    a = head.draw_masks(4, torch.Generator().manual_seed(1))
    assert a.device == w.device and a.dtype == torch.bool
    assert torch.equal(a, head.draw_masks(4, torch.Generator().manual_seed(1)))
    assert 0.65 < a.float().mean() < 0.75


@pytest.mark.parametrize("criterion", CRITERIA)
def test_p_drop_zero_under_sampling_equals_speculative_sampling(tiny, criterion):
    sampling = SamplingConfig(0.9, 1.0)
    for seed in range(3):
        prompt = random_prompt(seed)
        sd = Decoder(tiny, MethodConfig("sd", draft_len=4), sampling).generate(prompt, max_new_tokens=32, seed=seed)
        dm = Decoder(tiny, MethodConfig("dropmatch", draft_len=4, p_drop=0.0, criterion=criterion), sampling)
        out = dm.generate(prompt, max_new_tokens=32, seed=seed)
        assert out.stats.extra_accepts == 0
        assert out.stats.criterion_evaluations > 0
        assert out.stats.accepted_per_step == sd.stats.accepted_per_step
        assert out.token_ids == sd.token_ids


def test_screened_tiny_pair_decisions_equal_exact(tiny):
    """Screened clean logits in the verify step (certified decisions on the sparse path at small p_drop):
    same tokens as with float32 clean logits."""
    for p_drop in (0.05, 0.3):
        for seed in range(3):
            prompt = random_prompt(seed)
            config = MethodConfig("dropmatch", draft_len=5, p_drop=p_drop)
            exact = Decoder(tiny, config).generate(prompt, max_new_tokens=32, seed=seed)
            with screened_heads(tiny.target):
                decoder = Decoder(tiny, config)
                decoder.rule.criterion.screened_clean_logits = True  # even where float32 ones would be cheaper
                fast = decoder.generate(prompt, max_new_tokens=32, seed=seed)
            assert fast.token_ids == exact.token_ids


def test_screened_clean_bounds_hold_per_token():
    """The per-token bound on the screened head's bfloat16 logits holds at every token, is covered by the
    one number per row that greedy certification reads, and is tighter than the screened head's own
    one-number bound (largest row norm, largest logit) at most tokens."""
    from dropmatch.heads.screened import ScreenedHead, rounding_bound

    g = torch.Generator().manual_seed(0)
    tighter = []
    for _ in range(10):
        weight = torch.randn(500, 64, generator=g) * torch.rand(500, 1, generator=g)
        hidden = 10 * torch.randn(6, 64, generator=g)
        approx = ScreenedHead(weight, refine_margin=0.0)(hidden)
        exact = (hidden.double() @ weight.double().T).float()
        head = DropoutHead(weight, k=5, p_drop=0.03)
        bound = head.screened_clean_bounds(hidden, approx)
        assert bool(((approx - exact).abs() <= bound).all())
        assert bool((bound <= head.screened_clean_bound_max(hidden, approx)).all())  # one number per row covers them
        one_number = rounding_bound(torch.bfloat16, 64, float(weight.norm(dim=1).max()), hidden.norm(dim=-1, keepdim=True),
                                    approx.abs().amax(-1, keepdim=True))
        tighter.append(float((bound < one_number).float().mean()))
    assert min(tighter) > 0.5


BYTE_PATH = pytest.param(dict(sparse=True, compute_dtype=torch.float32, sparse_dtype=BYTE_ROWWISE), id="sparse-8bit",
                         marks=pytest.mark.skipif(not byte_bags_supported(), reason="needs fbgemm (x86)"))


@pytest.mark.parametrize("path", [pytest.param(dict(sparse=True, compute_dtype=torch.float32), id="sparse"),
                                  pytest.param(dict(sparse=False), id="dense"), BYTE_PATH,
                                  pytest.param(dict(exact_rows=True, rows_dtype=torch.bfloat16), id="rows")])
def test_dropout_heads_follow_a_weight_changed_in_place(path):
    """A checkpoint loaded into the model after the heads were built (an in-place copy of the head
    weight): the heads use the new weight on every path, not their copies of the old one (the
    transposed blocks, the compute-dtype copy given at construction, the norms of the bounds)."""
    g = torch.Generator().manual_seed(5)
    weight, hidden = torch.randn(300, 32, generator=g), torch.randn(3, 32, generator=g)
    head = DropoutHead(weight, k=5, p_drop=0.3, weight_in_compute_dtype=weight.bfloat16(), vocab_block=128, **path)

    def heads() -> tuple[torch.Tensor, torch.Tensor]:
        masks = head.draw_masks(3, torch.Generator().manual_seed(0))
        if head.exact_rows:
            logits, bounds = head.row_logits(hidden, masks)
        else:
            logits = head.logits(hidden, F.linear(hidden, weight), masks, sparse_dtype=head.sparse_dtype)
            bounds = head.product_bounds(hidden, masks, F.linear(hidden, weight), logits, fused=False,
                                         sparse_dtype=head.sparse_dtype) * head.error_scale(False)
        expected = F.linear(hidden.double().unsqueeze(1) * masks / 0.7, weight.double())
        return (logits.double() - expected).abs().amax(-1), bounds.double()

    heads()
    head.row_norms()  # the screened-clean bounds' norms, built on the old weight
    held = head._blocks.get(head.compute_dtype)  # a twin head built before the change would still hold the old copy
    held_bytes = head._byte_blocks
    with torch.no_grad():
        weight.copy_(torch.randn(300, 32, generator=g) * 3)
    err, bounds = heads()
    tolerance = 1e-4 if head.compute_dtype == torch.float32 and not head.exact_rows else 0.0
    assert bool((err <= bounds + tolerance).all()), (err, bounds)
    assert held is None or head.weight_blocks is not held
    assert held_bytes is None or head.byte_blocks() is not held_bytes
    torch.testing.assert_close(head.row_norms()[0], weight.norm(dim=1))  # what the bounds scale with
    assert head.max_row_norm == pytest.approx(float(weight.norm(dim=1).max()))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_steps_take_exact_sparse_corrections_on_the_cpu_default(top_p):
    """The CPU default's sparse heads correct in 8 bits (or bfloat16) only under greedy decoding (one bound per head
    certifies); under sampling they take the exact float32 corrections, so no position needs a certificate
    (under top-p none exists: each would be recomputed by the K-row pass)."""
    if not onednn_linear_supported():
        pytest.skip("the CPU default's two float32 paths need oneDNN")
    sampling = SamplingConfig(0.8, top_p)
    evaluations = 0
    for seed in range(10):
        weight, inp = random_case(seed, sampling, vocab=400, d=32)
        rule = DropMatch(DropoutHead(weight, k=5, p_drop=0.03), "js+majority")
        assert rule.head.sparse and rule.corrections_dtype(sampling) == torch.float32
        RelaxedVerification(rule).verify(_with(inp, seed))
        evaluations += rule.counters.evaluations
        assert rule.counters.exact_fallbacks == 0 and rule.counters.refined_tokens == 0
    assert evaluations > 0


def test_exact_on_reuses_its_gather_buffer_in_and_out_of_inference_mode(monkeypatch):
    """exact_on gathers into a kept buffer (where the native kernel does not serve the exact heads); one allocated
    under inference mode is not written outside it."""
    monkeypatch.setattr(onednn_linear, "native_few_rows_preferred", lambda: False)
    weight = torch.randn(300, 16)
    head = DropoutHead(weight, k=3, p_drop=0.3, compute_dtype=torch.float32, sparse=True)
    hidden = torch.randn(1, 16)
    masks = head.draw_masks(1, torch.Generator().manual_seed(0))
    tokens = torch.tensor([3, 7, 250])
    expected = F.linear(hidden.double().unsqueeze(1) * masks / 0.7, weight[tokens].double())
    with torch.inference_mode():
        inside = head.exact_on(hidden, masks, tokens)
    outside = head.exact_on(hidden, masks, torch.tensor([3, 7, 250]))
    for got in (inside, outside):
        assert torch.allclose(got.double(), expected, atol=1e-5)
    assert head._gathered is not None


def test_exact_on_by_the_native_kernel_equals_the_exact_heads_on_those_tokens(monkeypatch):
    """Where the native kernel serves the exact heads, exact_on reads the tokens' rows of W in place (no gathered
    copy) and gives exact_logits' values there bit for bit, for tokens in any order, repeated or none."""
    if not (kernels.available() and onednn_linear_supported()):
        pytest.skip("the native kernels (x86-64 Linux with a C compiler) on a torch with oneDNN's linear ops")
    monkeypatch.setattr(onednn_linear, "native_few_rows_preferred", lambda: True)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3000, 40, generator=g)
    head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.float32, sparse=True)
    hidden = torch.randn(1, 40, generator=g)
    masks = head.draw_masks(1, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        exact = head.exact_logits(hidden, masks)  # (1, K, V): the native kernel's whole product (K <= 16 rows)
        for tokens in (torch.tensor([2999, 5, 17, 5, 0]), torch.randperm(3000, generator=g)[:700],
                       torch.empty(0, dtype=torch.long)):
            assert torch.equal(head.exact_on(hidden, masks, tokens), exact[..., tokens])
    assert head._gathered is None
