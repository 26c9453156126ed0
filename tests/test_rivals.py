"""FLy and static ensemble verification (DIVERSED): hand-built decisions, exactness anchors,
chi-square tests of the ensemble's output distribution, end-to-end runs on the tiny pair."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from scipy.stats import chisquare

from dropmatch import cli
from dropmatch.errors import ConfigError
from dropmatch.heads.byte_columns import byte_bags_supported
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.models import load_pair
from dropmatch.onednn_linear import bf16_matmul_supported, onednn_linear_supported
from dropmatch.rules import (
    DivergenceThreshold,
    FLyVerification,
    RelaxedVerification,
    StandardVerification,
    StaticEnsembleVerification,
    TopK,
    TypicalAcceptance,
    VerifyInput,
)
from dropmatch.rules.fly import top_k_entropy
from dropmatch.sampling import SamplingConfig, sample_with_uniform

GREEDY, SAMPLE = SamplingConfig(), SamplingConfig(1.0)
P_MIN = 1e-3
V = 8


def _inp(draft, target_logits, sampling=GREEDY, seed=0, draft_probs=None, draft_logits=None) -> VerifyInput:
    return VerifyInput(torch.as_tensor(draft, dtype=torch.long), draft_probs, target_logits,
                       torch.zeros(target_logits.shape[0], 4), sampling, torch.Generator().manual_seed(seed),
                       draft_logits)


def _peak(t: int) -> torch.Tensor:
    """A nearly deterministic target row (top-3 entropy ~ 1e-4) with argmax t."""
    row = torch.zeros(V)
    row[t] = 12.0
    return row


def _spread(t: int) -> torch.Tensor:
    """Three near-equal tokens t, t+1, t+2 (top-3 entropy ~ log 3) with argmax t."""
    row = torch.full((V,), -10.0)
    row[t], row[(t + 1) % V], row[(t + 2) % V] = 5.0, 4.9, 4.8
    return row


def _rows(*rows) -> torch.Tensor:
    return torch.stack(list(rows))


# ---------------------------------------------------------------------------------------------
# FLy


def test_top3_entropy_is_over_the_full_softmax_not_renormalised():
    p = torch.tensor([0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1])
    wanted = -sum(x * math.log(x) for x in (0.3, 0.2, 0.1))
    assert float(top_k_entropy(p.log())) == pytest.approx(wanted, rel=1e-5)
    renormalised = -sum(x / 0.6 * math.log(x / 0.6) for x in (0.3, 0.2, 0.1))
    assert abs(wanted - renormalised) > 0.05  # the two readings are told apart
    assert float(top_k_entropy(_spread(0))) == pytest.approx(math.log(3), abs=0.01)
    assert float(top_k_entropy(_peak(0))) < 1e-3


@pytest.mark.parametrize("gate, window_ok, kept", [(True, True, True), (False, True, False),
                                                    (True, False, False), (False, False, False)])
def test_fly_keeps_a_mismatch_only_when_both_tests_pass(gate, window_ok, kept):
    """Draft 1 2 3 4 5 (L = 5), W = 2: the target disagrees at position 0 (wants 6)."""
    first = _spread(6) if gate else _peak(6)
    third = _peak(3) if window_ok else _peak(7)  # position 2 breaks the window when not ok
    logits = _rows(first, _peak(2), third, _peak(4), _peak(5), _peak(0))
    verdict = FLyVerification(entropy_threshold=0.3, window=2).verify(_inp([1, 2, 3, 4, 5], logits))
    if kept:
        assert (verdict.n_accepted, verdict.next_token, verdict.extra_accepts) == (5, 0, 1)
    else:
        assert (verdict.n_accepted, verdict.next_token, verdict.extra_accepts) == (0, 6, 0)
    assert verdict.criterion_evaluations == 1


def test_fly_threshold_is_inclusive_and_compared_with_top3_entropy():
    logits = _rows(_spread(6), _peak(2), _peak(3), _peak(4), _peak(0))
    h = float(top_k_entropy(logits[0]))
    assert FLyVerification(h, window=1).verify(_inp([1, 2, 3, 4], logits)).n_accepted == 4
    assert FLyVerification(h + 1e-4, window=1).verify(_inp([1, 2, 3, 4], logits)).n_accepted == 0


def test_fly_window_near_the_end_of_the_draft():
    """As in the authors' code, a kept mismatch at j needs j + W + 2 <= L: its window must end
    before the draft's last token; W = 0 (gate only) keeps mismatches anywhere."""
    rule = FLyVerification(0.3, window=2)
    # L = 5, mismatch at j = 1, positions 2, 3, 4 exact: 1 + 2 + 2 <= 5, kept
    logits = _rows(_peak(1), _spread(6), _peak(3), _peak(4), _peak(5), _peak(0))
    assert rule.verify(_inp([1, 2, 3, 4, 5], logits)).n_accepted == 5
    # L = 5, mismatch at j = 2, positions 3, 4 exact (a full window, but it ends on the last token): rejected
    logits = _rows(_peak(1), _peak(2), _spread(6), _peak(4), _peak(5), _peak(0))
    verdict = rule.verify(_inp([1, 2, 3, 4, 5], logits))
    assert (verdict.n_accepted, verdict.next_token) == (2, 6)
    # the same mismatch with one more draft token after the window: kept
    logits = _rows(_peak(1), _peak(2), _spread(6), _peak(4), _peak(5), _peak(7), _peak(0))
    assert rule.verify(_inp([1, 2, 3, 4, 5, 7], logits)).n_accepted == 6
    # fewer than W tokens after the mismatch: rejected
    logits = _rows(_peak(1), _peak(2), _peak(3), _spread(6), _peak(5), _peak(0))
    assert rule.verify(_inp([1, 2, 3, 4, 5], logits)).n_accepted == 3
    # W = 0: the gate alone, even at the last position
    logits = _rows(_peak(1), _peak(2), _peak(3), _peak(4), _spread(6), _peak(0))
    verdict = FLyVerification(0.3, window=0).verify(_inp([1, 2, 3, 4, 5], logits))
    assert (verdict.n_accepted, verdict.next_token, verdict.extra_accepts) == (5, 0, 1)


def test_fly_windows_count_exact_accepts_only():
    """Two gated mismatches next to each other: neither window is all exact, so neither is kept."""
    logits = _rows(_spread(6), _spread(7), _peak(3), _peak(4), _peak(5), _peak(0))
    assert FLyVerification(0.3, window=1).verify(_inp([1, 2, 3, 4, 5], logits)).n_accepted == 0
    # separated by a full window, both are kept
    logits = _rows(_spread(6), _peak(2), _spread(7), _peak(4), _peak(5), _peak(0))
    verdict = FLyVerification(0.3, window=1).verify(_inp([1, 2, 3, 4, 5], logits))
    assert (verdict.n_accepted, verdict.extra_accepts, verdict.criterion_evaluations) == (5, 2, 2)


def test_fly_under_sampling_uses_speculative_sampling_accepts():
    """p(x) = 0 is always rejected, p(x) = q(x) > 0 always accepted, whatever the uniforms."""
    q = torch.full((3, V), 1.0 / V)
    for broken in (False, True):
        logits = _rows(_spread(6), torch.zeros(V), torch.zeros(V), torch.zeros(V))  # rows 1, 2: p = q
        if broken:
            logits[1, 2] = -1e9  # the draft token at position 1 gets p = 0: the window of position 0 fails
        for seed in range(5):
            verdict = FLyVerification(0.3, window=1).verify(_inp([1, 2, 3], logits, SAMPLE, seed, draft_probs=q))
            assert verdict.n_accepted == (0 if broken else 3)  # 0 + 1 + 2 <= 3 when the window holds


def _random_case(seed: int, n: int, sampling: SamplingConfig, one_hot: bool = False):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n + 1, V, generator=g) * 2
    draft_logits = target[:n] + torch.randn(n, V, generator=g) * 1.5
    q = sampling.probs(draft_logits)
    draft = torch.stack([sample_with_uniform(q[j], torch.rand((), generator=g)) for j in range(n)])
    if one_hot:
        return dict(draft=draft, target_logits=target)
    if sampling.greedy:
        return dict(draft=draft_logits.argmax(-1), target_logits=target, draft_logits=draft_logits)
    return dict(draft=draft, target_logits=target, draft_probs=q)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE], ids=["greedy", "sampling"])
@pytest.mark.parametrize("one_hot", [False, True], ids=["model", "one-hot"])
def test_unreachable_fly_gate_and_ensemble_weight_one_are_standard_verification(sampling, one_hot):
    rules = [FLyVerification(entropy_threshold=2.0, window=1), StaticEnsembleVerification(1.0)]
    for seed in range(40):
        case = _random_case(seed, 4, sampling, one_hot)
        wanted = StandardVerification().verify(_inp(seed=seed, sampling=sampling, **case))
        for rule in rules:
            got = rule.verify(_inp(seed=seed, sampling=sampling, **case))
            assert (got.n_accepted, got.next_token, got.extra_accepts) == (wanted.n_accepted, wanted.next_token, 0)


# ---------------------------------------------------------------------------------------------
# static ensemble


def _log(p) -> torch.Tensor:
    return torch.tensor(p).clamp(min=1e-12).log()


def test_ensemble_greedy_takes_argmax_of_the_mixture():
    """p = (.5, 0, .4, .1), q = (0, .55, .45, 0); the draft token is 1 = argmax q, argmax p = 0.
    w = 0.5: v = (.25, .275, .425, .05), argmax v = 2 (neither p's nor q's choice): reject, emit 2.
    w = 0.1: v = (.05, .495, .445, .01): keep the draft token (an extra accept)."""
    p, q = [0.5, 0.0, 0.4, 0.1], [0.0, 0.55, 0.45, 0.0]
    target = torch.stack([_log(p), _log([0.1, 0.2, 0.3, 0.4])])
    inp = _inp([1], target, draft_logits=_log(q).view(1, -1))
    verdict = StaticEnsembleVerification(0.5).verify(inp)
    assert (verdict.n_accepted, verdict.next_token) == (0, 2)
    verdict = StaticEnsembleVerification(0.1).verify(inp)
    assert (verdict.n_accepted, verdict.next_token, verdict.extra_accepts) == (1, 3, 1)  # bonus = argmax p
    assert StandardVerification().verify(inp).next_token == 0


def test_ensemble_greedy_with_a_one_hot_draft_is_a_probability_gap_rule():
    """v(x) = w p(x) + 1 - w against w p(y): keep x iff max_{y != x} p(y) - p(x) < (1 - w) / w,
    else emit argmax p; for w <= 1/2 every draft token is kept."""
    g = torch.Generator().manual_seed(0)
    decided = {True: 0, False: 0}
    for trial in range(200):
        logits = torch.randn(2, V, generator=g) * 3
        x = int(torch.randint(V, (1,), generator=g))
        w = [0.3, 0.5, 0.7, 0.9][trial % 4]
        p = torch.softmax(logits[0], -1)
        gap = float(torch.cat([p[:x], p[x + 1 :]]).max() - p[x])
        verdict = StaticEnsembleVerification(w).verify(_inp([x], logits))
        kept = gap < (1 - w) / w
        assert (verdict.n_accepted == 1) == kept
        assert verdict.next_token == int(logits[int(kept)].argmax())
        decided[kept] += 1
    assert min(decided.values()) > 20  # both branches were exercised


def _ensemble_case(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n + 1, 6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(n, 6, generator=g) * 1.5, -1)
    return p, q


def _emitted_by_depth(rule, p, q, trials, seed):
    """Counts of the token emitted at each depth of one verify step (draft tokens drawn from q)."""
    n, vocab = q.shape
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(n + 1, vocab)
    logits = p.log()
    for _ in range(trials):
        draft = torch.stack([sample_with_uniform(q[j], torch.rand((), generator=gen)) for j in range(n)])
        verdict = rule.verify(VerifyInput(draft, q, logits, torch.zeros(n + 1, 4), SAMPLE, gen))
        for d in range(verdict.n_accepted):
            counts[d, draft[d]] += 1
        counts[verdict.n_accepted, verdict.next_token] += 1
    return counts


@pytest.mark.parametrize("w", [0.3, 0.7])
def test_ensemble_sampling_emits_the_mixture_at_one_position(w):
    p, q = _ensemble_case(0, 1)
    counts = _emitted_by_depth(StaticEnsembleVerification(w), p, q, 10000, seed=1)[0]
    v = w * p[0] + (1 - w) * q[0]
    assert chisquare(counts, v * counts.sum()).pvalue > P_MIN
    assert chisquare(counts, p[0] * counts.sum()).pvalue < P_MIN  # the test tells v from p


def test_ensemble_sampling_emits_the_mixture_at_every_depth_and_bonus_from_p():
    """L = 3 with position-wise p_j, q_j: the token emitted at depth d < 3 follows v_d, the bonus p_3."""
    w = 0.5
    p, q = _ensemble_case(2, 3)
    counts = _emitted_by_depth(StaticEnsembleVerification(w), p, q, 8000, seed=3)
    for d in range(4):
        wanted = w * p[d] + (1 - w) * q[d] if d < 3 else p[3]
        assert counts[d].sum() > 1000
        assert chisquare(counts[d], wanted * counts[d].sum()).pvalue > P_MIN


def test_ensemble_accepts_at_least_what_standard_sampling_accepts():
    for seed in range(40):
        case = _random_case(seed, 5, SAMPLE)
        std = StandardVerification().verify(_inp(seed=seed, sampling=SAMPLE, **case))
        ens = StaticEnsembleVerification(0.6).verify(_inp(seed=seed, sampling=SAMPLE, **case))
        assert ens.n_accepted >= std.n_accepted
        assert (ens.extra_accepts > 0) == (ens.n_accepted > std.n_accepted)


@pytest.mark.parametrize("rule, kwargs", [(FLyVerification, {"entropy_threshold": -0.1}),
                                          (FLyVerification, {"window": -1}),
                                          (StaticEnsembleVerification, {"weight": 0.0}),
                                          (StaticEnsembleVerification, {"weight": 1.5})])
def test_bad_options(rule, kwargs):
    with pytest.raises(ConfigError):
        rule(**kwargs)


# ---------------------------------------------------------------------------------------------
# end to end on the tiny pair


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny")


def _comparable(stats) -> dict:
    """What a generation decided, without its costs (timings; the head's rows: standard verification cuts
    drafts at a certain rejection, engine.cut_draft, and relaxed rules cannot)."""
    d = stats.to_dict()
    return {k: v for k, v in d.items()
            if not k.endswith("_s") and k not in ("tokens_per_s", "criterion_evaluations", "head_rows_per_step")}


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE], ids=["greedy", "sampling"])
def test_anchors_reproduce_sd_end_to_end(pair, sampling):
    for seed in range(3):
        sd = Decoder(pair, MethodConfig("sd", draft_len=4), sampling).generate("Hello there", 32, seed=seed)
        for config in (MethodConfig("fly", draft_len=4, fly_entropy=5.0, fly_window=1),
                       MethodConfig("ensemble", draft_len=4, ensemble_weight=1.0)):
            out = Decoder(pair, config, sampling).generate("Hello there", 32, seed=seed)
            assert out.token_ids == sd.token_ids
            assert _comparable(out.stats) == _comparable(sd.stats)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE], ids=["greedy", "sampling"])
def test_lossy_settings_accept_more_end_to_end(pair, sampling):
    sd = Decoder(pair, MethodConfig("sd", draft_len=4), sampling).generate("Hello there", 40, seed=0)
    # threshold 0 and no window: every mismatch is kept, so every step keeps its whole draft
    fly = Decoder(pair, MethodConfig("fly", draft_len=4, fly_entropy=0.0, fly_window=0), sampling)
    out = fly.generate("Hello there", 40, seed=0)
    assert out.stats.accepted_per_step == out.stats.drafted_per_step and out.stats.extra_accepts > 0
    windowed = Decoder(pair, MethodConfig("fly", draft_len=4, fly_entropy=0.0, fly_window=1), sampling)
    ens = Decoder(pair, MethodConfig("ensemble", draft_len=4, ensemble_weight=0.5), sampling)
    for decoder in (windowed, ens):
        out = decoder.generate("Hello there", 40, seed=0)
        assert len(out.token_ids) == 40 or out.token_ids[-1] in pair.eos_token_ids
        assert out.stats.extra_accepts > 0 and out.stats.tau > sd.stats.tau


def test_ngram_drafter_runs_with_both(pair):
    for config in (MethodConfig("fly", draft="ngram", fly_entropy=0.0, fly_window=1),
                   MethodConfig("ensemble", draft="ngram", ensemble_weight=0.4)):
        for sampling in (GREEDY, SAMPLE):
            out = Decoder(pair, config, sampling).generate("abc abc abc abc abc", 24, seed=0)
            assert len(out.token_ids) == 24


def test_command_line_parameters(capsys):
    args = cli.build_parser().parse_args(["generate", "--method", "fly", "--fly-entropy", "0.4", "--fly-window",
                                          "3", "--ensemble-weight", "0.8", "--prompt", "x"])
    config = cli.method_config(args)
    assert (config.method, config.fly_entropy, config.fly_window, config.ensemble_weight) == ("fly", 0.4, 3, 0.8)
    assert config.label == "fly(H3>=0.4,W=3)@L5"
    assert MethodConfig("ensemble", ensemble_weight=0.8).label == "ensemble(w=0.8)@L5"
    rc = cli.main(["generate", "--pair", "tiny", "--method", "ensemble", "--ensemble-weight", "0.5", "--draft-len",
                   "4", "--max-new-tokens", "16", "--prompt", "Hello there", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["new_tokens"] == 16


# ---------------------------------------------------------------------------------------------
# Review fixes: impossible tokens, NaN settings, w = 1 on near-ties, drafts that do not fit


def test_topk_never_accepts_a_token_the_target_rules_out():
    logits = _rows(torch.tensor([5.0] + [-math.inf] * (V - 1)), _peak(0))
    for token in range(1, V):  # any of them may be among torch's "top 2" ties
        assert RelaxedVerification(TopK(2)).verify(_inp([token], logits)).n_accepted == 0
    assert RelaxedVerification(TopK(V + 3)).verify(_inp([0], logits)).n_accepted == 1  # K past V: all possible ones
    with pytest.raises(ConfigError, match="integer"):
        TopK(2.5)


@pytest.mark.parametrize("build", [lambda: DivergenceThreshold("js", math.nan), lambda: FLyVerification(math.nan),
                                   lambda: TypicalAcceptance(0.09, math.nan)], ids=["divergence", "fly", "typical"])
def test_nan_settings_are_refused(build):
    with pytest.raises(ConfigError):
        build()


def test_ensemble_at_weight_one_is_standard_verification_on_near_ties():
    near = torch.full((V,), -3.0)
    near[0] = 0.1
    near[1] = torch.nextafter(near[0], torch.tensor(1.0))  # the argmax is 1; softmax gives both the same probability
    assert near[1] > near[0]
    logits = _rows(near, _peak(2))
    assert torch.softmax(near, -1)[0] == torch.softmax(near, -1)[1]
    for draft in ([0], [1]):
        ensemble, standard = (rule.verify(_inp(draft, logits)) for rule in (StaticEnsembleVerification(1.0),
                                                                             StandardVerification()))
        assert (ensemble.n_accepted, ensemble.next_token) == (standard.n_accepted, standard.next_token), draft


def test_a_draft_that_does_not_fit_the_target_vocabulary_is_refused(tiny):
    from dropmatch.drafters import Draft
    from dropmatch.engine import verify_step
    from dropmatch.errors import VocabularyMismatchError

    target = tiny.target
    vocab, hidden = target.vocab_size, torch.zeros(3, int(target.head_weight.shape[1]))
    ok = torch.tensor([1, 2])
    bad = [Draft(torch.tensor([1, vocab])), Draft(torch.tensor([-1, 2])), Draft(torch.tensor([1])),
           Draft(ok, probs=torch.full((2, vocab + 2), 1.0 / (vocab + 2))), Draft(ok, logits=torch.zeros(2, vocab - 1))]
    for draft in bad:
        with pytest.raises(VocabularyMismatchError):
            verify_step(target, StandardVerification(), hidden, draft, SAMPLE, torch.Generator().manual_seed(0))
    verify_step(target, StandardVerification(), hidden, Draft(ok, logits=torch.zeros(2, vocab)), SAMPLE,
                torch.Generator().manual_seed(0))


def test_fly_that_can_never_keep_a_mismatch_is_refused():
    """FLy keeps a mismatch only where its window ends before the draft's last token: at the default
    window 5 a draft of 5 never allows that, and the method would silently be standard SD."""
    with pytest.raises(ConfigError, match="draft-len >= 7"):
        MethodConfig("fly")
    with pytest.raises(ConfigError, match="draft-len >= 4"):
        MethodConfig("fly", draft_len=3, fly_window=2)
    assert MethodConfig("fly", draft_len=7).fly_window == 5
    assert MethodConfig("fly", draft_len=2, fly_window=0).fly_window == 0  # no window: the entropy gate alone


def test_a_head_dtype_that_does_not_apply_is_said():
    """On a CPU float32 head, --head-dtype bfloat16 applies where the CPU has native bfloat16 (rows for
    argmax votes) and to sparse corrections, which then read 8-bit columns on x86 (else bfloat16 where
    native; greedy JS criteria take them at p_drop 0.3 too); elsewhere the dropout heads are exact float32,
    and that is said."""
    tiny = load_pair("tiny")
    native = bf16_matmul_supported() and onednn_linear_supported()
    reduced_sparse = onednn_linear_supported() and (byte_bags_supported() or bf16_matmul_supported())
    if not reduced_sparse:
        with pytest.warns(UserWarning, match="does not apply"):
            Decoder(tiny, MethodConfig("dropmatch", p_drop=0.032, head_dtype="bfloat16"))
    with warnings.catch_warnings():  # float32 asked, float32 computed (exact rows at p 0.3, sparse at 0.032)
        warnings.simplefilter("error")
        for p_drop in (0.3, 0.032):
            Decoder(tiny, MethodConfig("dropmatch", p_drop=p_drop, head_dtype="float32"))
            Decoder(tiny, MethodConfig("dropmatch", p_drop=p_drop, head_dtype="fp32"))  # an alias of it
        if reduced_sparse:  # 8-bit (or bfloat16) sparse corrections
            Decoder(tiny, MethodConfig("dropmatch", p_drop=0.032, head_dtype="bfloat16"))
        if native:  # bfloat16 rows for greedy argmax votes
            Decoder(tiny, MethodConfig("dropmatch", p_drop=0.3, criterion="naive", head_dtype="bfloat16"))
    js_rows = MethodConfig("dropmatch", p_drop=0.3, criterion="js", head_dtype="bfloat16")
    if onednn_linear_supported() and byte_bags_supported():  # JS criteria take 8-bit sparse heads there
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Decoder(tiny, js_rows)
    elif native:
        with pytest.warns(UserWarning, match="float32"):  # JS criteria take float32 rows
            Decoder(tiny, js_rows)
