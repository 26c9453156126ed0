"""DropMatch: invariants, hand-computed criteria, the cheap path, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.special import xlogy

from dropmatch.drafters import ModelDrafter, NgramDrafter
from dropmatch.engine import generate
from dropmatch.errors import ConfigError
from dropmatch.heads.dropout import DropoutHead, mask_seed
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.rules.divergence import js_divergence
from dropmatch.rules.dropmatch import (
    CRITERIA,
    DropMatch,
    _bounded_js_verdict,
    _log_normalizers,
    _tempered_logits,
    centroid_logits,
    decide,
    js_accepts,
    majority_accepts,
)
from dropmatch.sampling import SamplingConfig

from .conftest import make_tiny, random_prompt, screened_heads

GREEDY = SamplingConfig()


def _comparable(stats) -> dict:
    """The statistics of what a generation decided, without its costs: timings, and the head's rows (the
    standard rule's steps cut their drafts at a certain rejection, engine.cut_draft; relaxed rules cannot)."""
    d = stats.to_dict()
    return {k: v for k, v in d.items() if not k.endswith("_s") and k not in ("tokens_per_s", "head_rows_per_step")}


# ---------------------------------------------------------------------------------------------
# p_drop = 0 is standard verification


@pytest.mark.parametrize("criterion", CRITERIA)
def test_p_drop_zero_equals_greedy_sd(tiny, criterion):
    for seed in range(6):
        prompt = random_prompt(seed)
        sd = Decoder(tiny, MethodConfig("sd", draft_len=4)).generate(prompt, max_new_tokens=40, seed=seed)
        dm = Decoder(tiny, MethodConfig("dropmatch", draft_len=4, p_drop=0.0, criterion=criterion))
        out = dm.generate(prompt, max_new_tokens=40, seed=seed)
        assert out.token_ids == sd.token_ids
        sd_stats, dm_stats = _comparable(sd.stats), _comparable(out.stats)
        assert dm_stats.pop("criterion_evaluations") > 0  # the criterion was asked
        sd_stats.pop("criterion_evaluations")
        assert dm_stats == sd_stats and out.stats.extra_accepts == 0


def test_p_drop_zero_heads_equal_clean_logits():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g)
    hidden = torch.randn(3, 8, generator=g)
    clean = hidden @ weight.T
    head = DropoutHead(weight, k=4, p_drop=0.0)
    logits = head.logits(hidden, clean, head.draw_masks(3, g))
    assert torch.equal(logits, clean.unsqueeze(1).expand(-1, 4, -1))


@pytest.mark.parametrize("criterion", CRITERIA)
def test_p_drop_zero_rejects_near_ties_as_standard_verification_does(criterion):
    """Drafts within 1e-3..1e-7 nats of the target's top token, whose row nearly ties the top row: at
    p_drop = 0 standard verification rejects them, and so must DropMatch on every head path. Computed
    heads put float32 noise (~1e-8 nats) into the centroid and the JS sums, which accepted such drafts."""
    from dropmatch.rules import RelaxedVerification, StandardVerification, VerifyInput

    paths = [dict(sparse=True, compute_dtype=torch.float32), dict(sparse=False, compute_dtype=torch.float32),
             dict(exact_rows=True), dict(sparse=False, compute_dtype=torch.bfloat16)]
    for trial in range(30):
        g = torch.Generator().manual_seed(trial)
        weight = torch.randn(300, 32, generator=g)
        hidden = torch.randn(2, 32, generator=g) * 3
        top = int((hidden[0] @ weight.T).argmax())
        draft = (top + 1) % 300
        weight[draft] = weight[top] * (1 - 10.0 ** (-(trial % 7) - 1))  # a near tie
        clean = hidden @ weight.T
        top = int(clean[0].argmax())
        draft_logits = clean[:1].clone()
        draft_logits[0, draft] = clean[0, top] + 10.0 ** (-(trial % 5) - 3)  # the draft's top, barely
        inp = VerifyInput(torch.tensor([draft]), None, clean, hidden, GREEDY, torch.Generator().manual_seed(1),
                          draft_logits)
        standard = StandardVerification().verify(inp)
        for path in paths:
            rule = RelaxedVerification(DropMatch(DropoutHead(weight, k=5, p_drop=0.0, **path), criterion))
            verdict = rule.verify(inp)
            assert (verdict.n_accepted, verdict.next_token) == (standard.n_accepted, standard.next_token), (trial, path)


def test_dropout_head_matches_definition():
    """Head i equals W (h * m_i / (1 - p)) (up to bfloat16 perturbation rounding)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 16, generator=g) * 0.3
    hidden = torch.randn(2, 16, generator=g) * 3
    clean = hidden @ weight.T
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=dtype)
        masks = head.draw_masks(2, torch.Generator().manual_seed(2))
        expected = torch.einsum("nkd,vd->nkv", hidden.unsqueeze(1) * masks / 0.7, weight)
        torch.testing.assert_close(head.logits(hidden, clean, masks), expected, atol=tol, rtol=tol)
        assert 0.6 < masks.float().mean() < 0.8


def test_masks_are_reproducible_and_seed_dependent():
    head = DropoutHead(torch.randn(10, 64), k=5, p_drop=0.3)
    a = head.draw_masks(4, torch.Generator().manual_seed(7))
    assert torch.equal(a, head.draw_masks(4, torch.Generator().manual_seed(7)))
    assert not torch.equal(a, head.draw_masks(4, torch.Generator().manual_seed(8)))



@pytest.mark.parametrize("consume", [True, False])
def test_step_masks_do_not_depend_on_what_is_asked_first(consume):
    """A step's masks drawn as asked: any order of positions gives the same masks, which on the CPU are one
    (L, K, d) draw from the seeded generator (the masks of every run before they were drawn lazily)."""
    head = DropoutHead(torch.randn(10, 64), k=5, p_drop=0.3)
    all_at_once = head.draw_masks(6, torch.Generator().manual_seed(11), consume)
    masks = head.step_masks(6, torch.Generator().manual_seed(11), consume)
    assert torch.equal(masks[3:5], all_at_once[3:5]) and torch.equal(masks[0:1], all_at_once[:1])
    assert torch.equal(masks[:], all_at_once) and masks[2:2].shape == (0, 5, 64) and len(masks) == 6
    seed = mask_seed(torch.Generator().manual_seed(11), consume)
    assert torch.equal(all_at_once, torch.rand((6, 5, 64), generator=torch.Generator().manual_seed(seed)) >= 0.3)
    fresh = head.step_masks(6, torch.Generator().manual_seed(11), consume)
    assert fresh[3:1].shape == (0, 5, 64) and torch.equal(fresh[0:2], all_at_once[:2])  # an empty ask draws nothing
    with pytest.raises(ValueError, match="contiguous positions"):
        masks[::2]


# ---------------------------------------------------------------------------------------------
# Hand-computed criteria


def _logits_for(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_naive_and_majority_by_hand():
    # five heads over four tokens; argmaxes: 0, 0, 1, 0, 2
    heads = _logits_for([[.7, .1, .1, .1], [.6, .2, .1, .1], [.2, .5, .2, .1], [.5, .3, .1, .1], [.3, .2, .4, .1]])
    tokens = heads.argmax(-1)
    q = torch.full((4,), 0.25)
    assert decide("naive", heads, 1, q, GREEDY, None)  # head 3 picks token 1
    assert not decide("naive", heads, 3, q, GREEDY, None)
    assert majority_accepts(tokens, 0, "strict")  # 3 of 5
    assert not majority_accepts(tokens, 1, "strict")
    assert majority_accepts(tokens, 0, "plurality")
    assert not majority_accepts(tokens, 2, "plurality")


def _no_draft_distribution() -> torch.Tensor:
    raise AssertionError("the draft distribution was asked for, though no JS test runs")


def test_vote_decisions_never_ask_for_the_draft_distribution():
    heads = _logits_for([[.7, .1, .1, .1], [.6, .2, .1, .1], [.2, .5, .2, .1], [.5, .3, .1, .1], [.3, .2, .4, .1]])
    assert decide("naive", heads, 1, _no_draft_distribution, GREEDY)
    assert not decide("majority", heads, 1, _no_draft_distribution, GREEDY)
    assert decide("js+majority", heads, 0, _no_draft_distribution, GREEDY)  # 3 of 5 heads: no JS test
    q = torch.full((4,), 0.25)
    assert decide("js+majority", heads, 3, lambda: q, GREEDY) == decide("js+majority", heads, 3, q, GREEDY)


@pytest.mark.parametrize("scale,offset", [(3.0, 0.0), (3.0, 75.0), (3.0, -95.0), (40.0, 0.0)],
                         ids=["moderate", "sums-overflow", "every-row-tiny", "exponentials-overflow"])
def test_log_normalizers_equal_float64_logsumexp(scale, offset):
    """Unshifted where the float32 sums allow, shifted by each row's maximum where they do not (a sum or
    an exponential past float32's range, or sums below 1e-8 made of subnormal terms): ln Z within 1e-6
    of float64 either way."""
    g = torch.Generator().manual_seed(1)
    logits = scale * torch.randn(5, 65536, generator=g) + offset
    logits[2] -= 30.0  # one row well below the others
    got = _log_normalizers(logits)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.logsumexp(logits.double(), -1), atol=1e-6, rtol=0)


def test_plurality_with_a_draft_id_above_every_head_token():
    assert not majority_accepts(torch.tensor([3, 3, 5]), 200, "plurality")
    assert not majority_accepts(torch.tensor([3, 3, 5]), 200, "strict")


def test_identical_heads_have_radius_exactly_zero():
    heads = torch.randn(1, 50).expand(5, -1).clone()
    centroid_dist = torch.softmax(heads[0], -1)
    assert js_accepts(heads, centroid_dist, GREEDY)  # JS(c || c) = 0 <= radius 0
    assert not js_accepts(heads, torch.softmax(heads[0] + 1e-3 * torch.arange(50.0), -1), GREEDY)


def test_majority_ties():
    tokens = torch.tensor([4, 4, 7, 7])  # K = 4, a 2-2 tie
    assert not majority_accepts(tokens, 4, "strict")  # 2 is not more than K/2
    assert not majority_accepts(tokens, 4, "plurality")  # a tie rejects
    assert not majority_accepts(tokens, 7, "plurality")
    assert majority_accepts(torch.tensor([4, 4, 7, 1]), 4, "plurality")  # 2 beats 1 and 1
    assert not majority_accepts(torch.tensor([4, 4, 7, 1]), 4, "strict")
    assert majority_accepts(torch.tensor([3, 3, 3]), 3, "strict")


def _full_js_test(heads: torch.Tensor, draft: torch.Tensor, sampling: SamplingConfig) -> bool:
    probs, centroid = sampling.probs(heads), sampling.probs(heads.mean(0))
    return bool(js_divergence(draft, centroid) <= js_divergence(probs, centroid).max())


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.7), SamplingConfig(temperature=0.7, top_p=0.9)])
def test_bounded_js_test_takes_the_full_tests_decisions_on_a_large_vocabulary(sampling):
    """On a 65k vocabulary with peaked heads (a few hundred likely tokens, a long tail), the JS test
    from the likely tokens and the tail's mass decides most cases, and always as the full test does,
    on draft distributions swept from inside the cluster to far outside it (towards another peaked
    distribution, or towards the uniform one, whose mass lies all in the tail)."""
    g = torch.Generator().manual_seed(0)
    vocab, decided, accepted, cases = 65536, 0, 0, 0
    for trial in range(6):
        base = 3 * torch.randn(vocab, generator=g)
        base[torch.randint(0, vocab, (200,), generator=g)] += 12.0
        heads = base + (0.2 + 0.2 * trial) * torch.randn(5, vocab, generator=g)
        centre = sampling.probs(centroid_logits(heads))
        away = sampling.probs(base + 2.0 * torch.randn(vocab, generator=g))
        flat = torch.full((vocab,), 1.0 / vocab)  # below JS_TAIL on every token: mass only the tail bound sees
        drafts = [(1 - mix) * centre + mix * other for other in (away, flat)
                  for mix in torch.linspace(0.0, 0.6, 7).tolist()]
        for draft in drafts:
            verdict = _bounded_js_verdict(*_tempered_logits(heads, sampling), draft)
            # keeping tokens by the heads' maximum alone when the centroid is their mean
            by_heads = _bounded_js_verdict(*_tempered_logits(heads, sampling), draft, centroid_is_mean=True)
            # the draft given as logits (softmax(log q) = q)
            from_logits = _bounded_js_verdict(*_tempered_logits(heads, sampling), draft.log(), q_is_logits=True)
            full = _full_js_test(heads, draft, sampling)
            assert js_accepts(heads, draft, sampling) == full
            if sampling.greedy:  # where the logits decide, the probabilities are never asked for
                lazy = _no_draft_distribution if from_logits is not None else draft
                assert js_accepts(heads, lazy, sampling, draft_logits=draft.log()) == full
            assert verdict is None or verdict == full
            assert by_heads is None or by_heads == full
            assert from_logits is None or from_logits == full
            decided, accepted, cases = decided + (verdict is not None), accepted + full, cases + 1
    assert decided >= 0.6 * cases  # the bounded test is what runs (the flat drafts often need the full one)
    assert 0 < accepted < cases  # both decisions occur


def test_js_stays_finite_and_decides_as_float64_on_very_peaked_heads():
    """Logits spread over more than ~103 nats give probabilities down to float32's smallest subnormal;
    JS stays within [0, ln 2] and the JS test takes the float64 test's decisions (the mixture's log once
    underflowed there: every radius was inf and ``inf <= inf`` accepted every draft)."""
    tiny = torch.tensor([1e-45, 1.0 - 1e-45])
    assert 0.0 <= float(js_divergence(tiny, torch.tensor([0.0, 1.0]))) <= math.log(2)
    g = torch.Generator().manual_seed(0)
    base = 20 * torch.randn(8192, generator=g)
    heads = base + 0.3 * torch.randn(5, 8192, generator=g)
    probs, centre = torch.softmax(heads, -1), torch.softmax(heads.mean(0), -1)
    radii = js_divergence(probs, centre)
    assert torch.isfinite(radii).all() and float(radii.max()) <= math.log(2)

    def js64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # float64, from the definition
        a, b = a.double(), b.double()
        m = (a + b) / 2
        return 0.5 * (xlogy(a, a) - xlogy(a, m)).sum(-1) + 0.5 * (xlogy(b, b) - xlogy(b, m)).sum(-1)

    decisions = []
    for spread in (0.1, 8.0):  # a draft inside the cluster, one far outside it
        q = torch.softmax(base + spread * torch.randn(8192, generator=g), -1)
        expected = bool(js64(q, centre) <= js64(probs, centre).max())
        assert _full_js_test(heads, q, GREEDY) == expected
        assert js_accepts(heads, q, GREEDY) == expected
        decisions.append(expected)
    assert decisions == [True, False]


def test_js_by_hand():
    # two heads, two tokens: p1 = (0.8, 0.2), p2 = (0.6, 0.4); centroid = softmax(mean logits)
    heads = _logits_for([[0.8, 0.2], [0.6, 0.4]])
    mean = heads.mean(0)
    c = torch.softmax(mean, -1)
    assert math.isclose(float(c[0]), math.sqrt(0.48) / (math.sqrt(0.48) + math.sqrt(0.08)), rel_tol=1e-6)

    def js(a, b):
        m = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
        return 0.5 * sum(x * math.log(x / z) for x, z in zip(a, m, strict=True)) + 0.5 * sum(
            y * math.log(y / z) for y, z in zip(b, m, strict=True))

    cl = c.tolist()
    radius = max(js([0.8, 0.2], cl), js([0.6, 0.4], cl))
    assert math.isclose(float(js_divergence(torch.exp(heads), c).max()), radius, rel_tol=1e-5)
    inside, outside = torch.tensor([0.7, 0.3]), torch.tensor([0.2, 0.8])
    assert js([0.7, 0.3], cl) <= radius < js([0.2, 0.8], cl)
    assert js_accepts(heads, inside, GREEDY)
    assert not js_accepts(heads, outside, GREEDY)
    # identical heads: radius 0, only the centroid itself is inside
    same = _logits_for([[0.8, 0.2]] * 3)
    assert not js_accepts(same, torch.tensor([0.79, 0.21]), GREEDY)
    # js+majority rescues the concentrated case (paper Fig. 4b)
    one_hot = torch.tensor([1.0, 0.0])
    assert not decide("js", same, 0, one_hot, GREEDY, None)
    assert decide("js+majority", same, 0, one_hot, GREEDY, None)


# ---------------------------------------------------------------------------------------------
# The cheap path (lazy heads, sparse or dense) against an independent dense computation:
# tests/test_sparse_heads.py::test_sparse_and_dense_paths_equal_dense_float64 (it replaces a test that
# compared the lazy heads with the package's own head code).


# ---------------------------------------------------------------------------------------------
# Decoding behaviour


def test_same_seed_same_output_different_seeds_can_differ(tiny):
    decoder = Decoder(tiny, MethodConfig("dropmatch", p_drop=0.3, draft_len=4))
    prompt = random_prompt(11)
    runs = [decoder.generate(prompt, max_new_tokens=48, seed=s).token_ids for s in (0, 0, 1, 2, 3)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1
    sampled = Decoder(tiny, MethodConfig("dropmatch", p_drop=0.3, draft_len=4), SamplingConfig(0.9, 1.0))
    runs = [sampled.generate(prompt, max_new_tokens=48, seed=s).token_ids for s in (0, 0, 1, 2)]
    assert runs[0] == runs[1]  # masks seeded from a hash of the step generator: the same seed, the same text
    assert len({tuple(r) for r in runs[1:]}) > 1


def test_dropmatch_accepts_more_on_tiny_pair(tiny):
    sd = dm = 0.0
    for seed in range(4):
        prompt = random_prompt(seed)
        sd += Decoder(tiny, MethodConfig("sd", draft_len=5)).generate(prompt, max_new_tokens=48).stats.tau
        result = Decoder(tiny, MethodConfig("dropmatch", draft_len=5)).generate(prompt, max_new_tokens=48)
        dm += result.stats.tau
        assert result.stats.extra_accepts > 0
    assert dm > sd


def test_sampling_and_ngram_paths_run(tiny):
    prompt = random_prompt(4)
    sampled = Decoder(tiny, MethodConfig("dropmatch", draft_len=4), SamplingConfig(0.8, 0.95))
    s = sampled.generate(prompt, max_new_tokens=32, seed=1).stats
    assert sum(s.accepted_per_step) + s.target_tokens == s.new_tokens
    ngram = generate(tiny.target, prompt, drafter=NgramDrafter(), draft_len=4, max_new_tokens=32,
                     rule=Decoder(tiny, MethodConfig("dropmatch", criterion="js")).rule)
    assert ngram.stats.new_tokens == 32


def test_bfloat16_model():
    pair = make_tiny("llama", dtype=torch.bfloat16)
    out = Decoder(pair, MethodConfig("dropmatch")).generate(random_prompt(0), max_new_tokens=16)
    assert out.stats.new_tokens == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tiny):
    from dropmatch.benchmarks.gpu_check import cuda_matches_cpu

    assert cuda_matches_cpu(make_tiny("llama"), random_prompt(0), max_new_tokens=32) is True


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("kwargs,match", [
    ({"k": 0}, "K"), ({"k": -3}, "K"), ({"k": True}, "K"), ({"p_drop": 1.0}, "p_drop"), ({"p_drop": -0.1}, "p_drop"),
    ({"p_drop": None}, "p_drop"), ({"p_drop": "0.3"}, "p_drop"),
    ({"criterion": "cosine"}, "criterion"), ({"majority": "some"}, "majority"),
])
def test_bad_dropmatch_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MethodConfig("dropmatch", **kwargs)


def test_bad_options_in_pure_classes():
    with pytest.raises(ConfigError, match="K"):
        DropoutHead(torch.zeros(4, 2), k=0)
    for weight in (torch.zeros(8), torch.zeros(4, 2, dtype=torch.int64)):
        with pytest.raises(ConfigError, match="LM-head weight"):
            DropoutHead(weight)
    for temperature in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="temperature"):
            SamplingConfig(temperature)
    with pytest.raises(ConfigError, match="criterion"):
        DropMatch(DropoutHead(torch.zeros(4, 2)), criterion="naive+js")
    with pytest.raises(ConfigError, match="method"):
        MethodConfig("medusa")


def test_greedy_heads_of_a_rows_head_ride_in_the_screened_gemm(tiny):
    """On the CPU default's rows head (large K p_drop), greedy steps put every position's dropout rows in the
    screened verification GEMM (bfloat16) and decide as exact float32 rows: argmax votes and JS, certified on
    one bound per head. Sampled steps and float32 clean logits keep the rows."""
    from dropmatch.drafters import Draft
    from dropmatch.engine import verify_step
    from dropmatch.rules import RelaxedVerification

    target, greedy = tiny.target, SamplingConfig()
    weight = target.head_weight
    with screened_heads(target), torch.inference_mode():
        for criterion in ("naive", "js+majority"):
            head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.bfloat16)
            if not head.exact_rows or head.rows_dtype != torch.bfloat16:
                pytest.skip("needs oneDNN with native bfloat16 (the rows head's certified bfloat16 rows)")
            rule = DropMatch(head, criterion)
            exact = DropMatch(DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.float32),
                              criterion)
            assert rule.fuses(greedy) and rule.heads_dtype(greedy) == torch.bfloat16 and not exact.fuses(greedy)
            assert not rule.fuses(SamplingConfig(0.8, 1.0))
            assert not DropMatch(head, criterion, screened_clean_logits=False).fuses(greedy)
            fused_calls, accepted = [], 0
            row_logits = head.row_logits
            head.row_logits = lambda *args, products=None, calls=fused_calls, row_logits=row_logits: (
                calls.append(products is not None) or row_logits(*args, products=products))
            for seed in range(16):
                g = torch.Generator().manual_seed(seed)
                _, hidden = target.new_cache(prompt_ids=torch.randint(3, 259, (12,), generator=g))
                hidden = hidden[-6:]
                clean = target.head(hidden)
                tokens = clean[:5].topk(2, -1).indices[:, 1]  # near misses, which only DropMatch accepts
                draft = Draft(tokens, None, clean[:5] + torch.randn(5, clean.shape[-1], generator=g))
                fused, expected = (verify_step(target, RelaxedVerification(r), hidden, draft, greedy,
                                               torch.Generator().manual_seed(seed)) for r in (rule, exact))
                assert (fused.n_accepted, fused.extra_accepts) == (expected.n_accepted, expected.extra_accepts)
                accepted += fused.extra_accepts
            assert fused_calls and all(fused_calls) and accepted > 0  # only fused rows; some near misses accepted
            assert rule._sparse_twin is None  # nor are the unfused positions' heads (JS: a sparse twin) built
        # the bounds the decisions rest on hold for the screened GEMM's products, against float64 heads
        prefetch = rule.prefetch(hidden, greedy, torch.Generator().manual_seed(0))
        _, products = target.head_with_extra(hidden, prefetch.rows, exact=False)
        masks = prefetch.state[:5]
        heads, bounds = head.row_logits(hidden[:5], masks, torch.bfloat16, products=products)  # (5, K, V), (5, K)
        exact_heads = torch.nn.functional.linear(hidden[:5].double().unsqueeze(1) * masks / 0.7, weight.double())
        errors = (heads.double() - exact_heads).abs().amax(-1)
        assert (errors <= bounds).all() and (errors > bounds / 100).all()


def test_model_drafter_interface_round_trip(tiny):
    """A drafter's proposal after commit continues the accepted prefix (cache bookkeeping)."""
    drafter = ModelDrafter(tiny.draft)
    prompt = random_prompt(9)
    drafter.start(prompt)
    first = drafter.propose(5, 4, GREEDY, torch.Generator()).tokens.tolist()
    drafter.commit(2)
    again = ModelDrafter(tiny.draft)
    again.start(torch.cat([prompt, torch.tensor([5] + first[:2])]))
    assert drafter.propose(77, 3, GREEDY, torch.Generator()).tokens.tolist() == \
        again.propose(77, 3, GREEDY, torch.Generator()).tokens.tolist()


def test_heads_fused_into_the_verification_gemm(tiny):
    """With the screened head on, the first positions' dropout rows ride in the verify GEMM."""
    target = tiny.target
    with screened_heads(target):
        for seed in range(3):
            prompt = random_prompt(seed)
            sd = Decoder(tiny, MethodConfig("sd")).generate(prompt, max_new_tokens=32)
            dm = Decoder(tiny, MethodConfig("dropmatch", p_drop=0.0)).generate(prompt, max_new_tokens=32)
            assert dm.token_ids == sd.token_ids  # p_drop = 0 stays exact through the fused path
        head = DropoutHead(target.head_weight, k=5, p_drop=0.3, sparse=False,
                           weight_in_compute_dtype=target.head_weight_as(torch.bfloat16))
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(6, target.head_weight.shape[1], generator=g)
        rows = head.perturbation_inputs(hidden[:2], head.draw_masks(2, g))
        logits, products = target.head_with_extra(hidden, rows, exact=False)
        assert products.shape == (10, target.vocab_size)
        assert products.dtype == torch.bfloat16  # the GEMM's own output, combined per position where asked
        torch.testing.assert_close(products.float(), torch.nn.functional.linear(rows, head.weight_c).float(),
                                   atol=2e-2, rtol=2e-2)
        assert torch.equal(logits.argmax(-1), target.head(hidden).argmax(-1))
        out = Decoder(tiny, MethodConfig("dropmatch")).generate(random_prompt(1), max_new_tokens=32)
        assert out.stats.extra_accepts > 0
