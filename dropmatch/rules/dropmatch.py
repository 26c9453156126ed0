"""DropMatch acceptance criteria (paper Sec. 3.2, Algorithm 1) on K dropout heads.

For a draft token x at a position, the K heads give logits l_1..l_K (K, V):

* ``naive``: x equals the token of at least one head (its argmax; under sampling, the token the
  head samples at the run's temperature / top-p).
* ``majority``: x is the heads' majority token. ``strict`` (default): more than K/2 heads pick x.
  ``plurality``: x is picked by strictly more heads than any other token (a tie rejects).
* ``js``: JS(q || c) <= max_i JS(p_i || c), with c = softmax(mean_i l_i) the centroid, p_i the
  heads' distributions and q the draft distribution (one-hot for drafters without one).
* ``js+majority`` (Algorithm 1, the default): js OR majority.

Distributions are untempered under greedy decoding and tempered / top-p under sampling.

**Head votes under sampling.** A head "picks" the draft token x when speculative sampling under that
head would accept it with the step's own uniform u_j: u_j q(x) < p_i(x) (the standard rule accepts
when u_j q(x) < p(x)). With p_drop = 0 every head equals the target, so naive and majority accept
exactly where speculative sampling does and DropMatch reduces to standard verification (sampling K
head tokens instead would accept near-misses by sampling noise alone, even at p_drop = 0). Under
sampling both majority rules mean "more heads accept than reject". The uniforms are the standard
rule's: :meth:`DropMatch.prepare` reads them from a copy of the step generator, which the standard
rule draws from right after the criterion (:class:`~dropmatch.rules.standard.RelaxedVerification`).

**Exact decisions on inexact logits.** Greedy verification may hand over screened bfloat16 logits
(exact argmax, bfloat16 accuracy off the top tokens), and the bfloat16 perturbation GEMMs or the 8-bit /
bfloat16 corrections add rounding. Each head logit then carries a rigorous bound (nats), and the decision
is taken only where the bounds certify it; otherwise the K heads are recomputed exactly. Decisions therefore equal
those computed from exact float32 head logits.

* Greedy decoding (:func:`tail_certified_decide`, one bound per head): votes are the heads' exact
  argmaxes among the tokens within twice the bound of each head's computed top. The JS test makes its
  kept tokens exact (the likely tokens of the heads, the centroid and the draft, first at 3e-4, then 3e-5,
  ...: a few hundred to a few thousand of 262k on the embedded pair); what stays uncertain is each
  normalizer, over a tail of small mass known within e^{+-bound}, and a normalizer's error moves the JS of
  close distributions little (:func:`_shift_sensitivity`). On the embedded pair it decides every position of
  35 recorded steps (js+majority; 8-bit corrections at p_drop 0.032, fused bfloat16 rows at 0.3).
* Sampling (:func:`certified_decide`, per-token bounds): the tokens near each head's top are made exact,
  then head argmaxes, per-head acceptance probabilities and the JS comparison are bounded over the whole
  vocabulary (how far JS can move: :func:`js_error_bound`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..heads.byte_columns import BYTE_ROWWISE
from ..heads.dropout import DropoutHead, StepMasks
from ..kernels import HeadStatistics, head_statistics, kept_tokens
from ..kernels import available as native_kernels_available
from ..sampling import SamplingConfig, argmax, indices_at_least, sample_with_uniform, true_indices
from .base import PositionTest, Prefetch, VerifyInput
from .divergence import js_bounds, js_divergence

CRITERIA = ("naive", "js", "majority", "js+majority")
JS_CRITERIA = ("js", "js+majority")  # the criteria that compare distributions, not only argmaxes
MAJORITY_RULES = ("strict", "plurality")


def check_criterion_args(criterion: str, majority: str = "strict") -> None:
    """Refuse an unknown criterion or majority rule with a clear error."""
    if criterion not in CRITERIA:
        raise ConfigError(f"unknown DropMatch criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    if majority not in MAJORITY_RULES:
        raise ConfigError(f"unknown majority rule {majority!r}; choose strict or plurality")


JS_SLACK = 1e-6  # nats: float32 evaluation noise of a JS value over the vocabulary


def head_tokens(head_logits: torch.Tensor, sampling: SamplingConfig, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Token of each head (K,): argmax under greedy decoding, else a sample with ``uniforms`` (K,)
    (the pre-vote reading of sampling, kept for analyses; :func:`decide` uses :func:`head_votes`)."""
    if sampling.greedy or uniforms is None:
        return argmax(head_logits)
    return sample_with_uniform(sampling.probs(head_logits), uniforms)


def head_votes(head_logits: torch.Tensor, draft_token: int, sampling: SamplingConfig,
               vote_threshold: float | None) -> torch.Tensor:
    """Whether each head picks ``draft_token`` (K,) bool: its argmax under greedy decoding; under
    sampling, speculative acceptance under the head, p_i(x) > ``vote_threshold`` (= u_j q(x))."""
    if sampling.greedy or vote_threshold is None:
        return argmax(head_logits) == draft_token
    return sampling.probs(head_logits)[:, draft_token] > vote_threshold


def majority_accepts(tokens: torch.Tensor, draft_token: int, rule: str = "strict") -> bool:
    """Whether ``draft_token`` is the majority of the heads' ``tokens`` (K,)."""
    votes = int((tokens == draft_token).sum())
    if rule == "strict":
        return 2 * votes > tokens.numel()
    others = tokens[tokens != draft_token]
    return votes > 0 and (others.numel() == 0 or votes > int(others.unique(return_counts=True)[1].max()))


def _votes_decide(criterion: str, votes: torch.Tensor, tokens: torch.Tensor | None, draft_token: int,
                  majority: str) -> bool:
    if criterion == "naive":
        return bool(votes.any())
    if tokens is None:  # sampling votes: more heads accept than reject
        return 2 * int(votes.sum()) > votes.numel()
    return majority_accepts(tokens, draft_token, majority)


JS_TAILS = (1e-5, 1e-7)  # probabilities below which a token (in every head, the centroid and the draft) is
# left out, tried in turn: on the embedded pair ~1-7k tokens stay at 1e-5 and the bounds decide ~95 % of
# the tests; the smaller cut decides most of the rest, where the full test costs ~3x the bounded ones
GATHERED_JS_TAILS = (3e-4, 3e-5, 3e-6, 3e-7, 1e-7)  # the same for :func:`tail_certified_decide`, whose kept
# tokens cost a gather of their rows of W (each token once over the cuts): the embedded pair keeps ~0.6k tokens at
# 1e-4 against ~2.7k at 1e-5 (p_drop 0.032), and at p_drop 0.3, where the heads spread, a first cut near 1e-3 decides
# most tests on far fewer tokens than 1e-4 did. Measured on 35 recorded steps (js+majority, the decisions alone,
# warm, 2-core AMX Xeon; p_drop 0.032 on 8-bit sparse heads, 0.3 on fused bfloat16 heads), ms a decision:
# 2.45-2.53 and 3.37-3.46 against 2.52-2.55 and 3.91 from (1e-3, 1e-4, ..., 1e-7), none undecided (stop 43's
# (1e-4, 1e-5, 1e-7) left 3 of 33 undecided at p_drop 0.3, each recomputed on float32 rows at ~30 ms)
SHARED_CUT_MAX_KEPT = 8192  # kept tokens above which :func:`tail_certified_decide` cuts each head on its own
JS_MAX_KEPT = 1 / 8  # share of the vocabulary above which the JS test runs on the whole vocabulary


def centroid_logits(head_logits: torch.Tensor) -> torch.Tensor:
    """Mean of the K head logits (K, V) -> (V,), in float32 (one read of the heads; every path, dense,
    sparse, certified or exact, takes its centroid here, so they agree on it). A sum and a division, as
    torch's CPU ``mean`` computes it, without its overhead (0.23 against 0.42 ms for 5 x 262k, 2-core Xeon)."""
    return head_logits.sum(dim=0).div_(head_logits.shape[0])


def _log_normalizers(logits: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """ln sum_v exp(logits) along the last axis, float64 (...,), from the float32 sum of the exponentials
    (the log taken in float64: a float32 ln Z of ~20 nats would carry ~2e-6 of rounding, more than
    :data:`JS_SLACK`), or from those ``sums`` (...,) where they were taken already
    (:func:`~dropmatch.kernels.head_statistics`).

    The logits are exponentiated as they are (no pass for the maximum, no rounding of a shift). That is
    kept where every row's sum is finite and at least 1e-8: the terms are positive, so no partial sum
    overflowed; the row's maximum lies above ln(1e-8 / V), so the terms that make its sum are normal
    floats, and those that underflow add less than V 1e-38. Otherwise each row is shifted by its maximum
    (exact) first."""
    if sums is None:
        sums = torch.exp(logits).sum(-1)
    low, high = torch.aminmax(sums.reshape(-1))
    if float(low) >= 1e-8 and math.isfinite(float(high)):
        return sums.double().log()
    row_top = logits.amax(-1, keepdim=True)
    shifted = (logits - row_top).exp_().sum(-1)
    return row_top.squeeze(-1).double() + shifted.double().log()


def _bounded_js_verdict(logits: torch.Tensor, centroid: torch.Tensor, q: torch.Tensor,
                        centroid_is_mean: bool = False, q_is_logits: bool = False) -> bool | None:
    """The JS test from the tokens where a distribution reaches a cut of :data:`JS_TAILS`, or ``None``
    if the bounds decide it at no cut (see :func:`js_accepts`): ``logits`` (K, V) the heads' (tempered)
    logits, ``centroid`` (V,) the centroid's, ``q`` (V,) the draft distribution (``q_is_logits``: logits
    whose softmax it is); ``centroid_is_mean``: the centroid logits are the heads' mean, so never above
    the heads' maximum. Every distribution is formed on the kept tokens only, from its log-normalizer;
    the masses off them are one minus the kept mass (float32 noise ~1e-7, well inside :data:`JS_SLACK`),
    so the vocabulary is read a few times (normalizers, the token pick) and no (K, V) probabilities are
    written.
    """
    head_max = logits.amax(0) if logits.shape[0] > 1 else logits[0]
    log_z = _log_normalizers(logits)
    log_zc = float(_log_normalizers(centroid))
    if q_is_logits:  # a softmax's mass is one; only its kept part is computed
        log_zq, draft_total = float(_log_normalizers(q)), torch.ones((), dtype=torch.float64)
    else:
        log_zq, draft_total = 0.0, q.sum(dtype=torch.float64)
    for tail in JS_TAILS:
        cut = math.log(tail)
        # a superset of the tokens where a head (or the centroid, at most the heads' maximum when it is
        # their mean) reaches the cut, from the lowest threshold on the heads' maximum (one read of the
        # logits, where a (K, V) comparison and its any() cost ~10x more). Any subset gives valid bounds;
        # the cut only sets how tight they are
        floor = float(log_z.min()) + cut
        kept = [indices_at_least(head_max, min(floor, log_zc + cut) if centroid_is_mean else floor),
                indices_at_least(q, log_zq + cut if q_is_logits else tail)]
        if not centroid_is_mean:
            kept.append(indices_at_least(centroid, log_zc + cut))
        tokens = torch.cat(kept).unique()
        if tokens.numel() > JS_MAX_KEPT * head_max.numel():
            return None
        heads = (logits.index_select(-1, tokens).double() - log_z.unsqueeze(-1)).exp()
        centre = (centroid.index_select(-1, tokens).double() - log_zc).exp()
        draft = q.index_select(-1, tokens).double()
        draft = (draft - log_zq).exp() if q_is_logits else draft
        centre_tail = max(0.0, 1.0 - float(centre.sum()))
        head_tails = (1.0 - heads.sum(-1)).clamp(min=0.0)
        draft_tail = (draft_total - draft.sum()).clamp(min=0.0).reshape(1)
        draft_lo, draft_hi = js_bounds(draft.unsqueeze(0), centre, draft_tail, centre_tail)
        radius_lo, radius_hi = js_bounds(heads, centre, head_tails, centre_tail)
        if float(draft_hi) + JS_SLACK <= float(radius_lo.max()) - JS_SLACK:
            return True
        if float(draft_lo) - JS_SLACK > float(radius_hi.max()) + JS_SLACK:
            return False
    return None


def _tempered_logits(head_logits: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' and the centroid's logits (K, V), (V,) whose softmaxes are the distributions of the
    JS test: untempered under greedy decoding, divided by the temperature under sampling, and the log of
    the top-p distributions under top-p sampling (-inf off the nucleus)."""
    if sampling.greedy:
        return head_logits.float(), centroid_logits(head_logits.float())
    if sampling.top_p < 1:
        return sampling.probs(head_logits).log(), sampling.probs(centroid_logits(head_logits)).log()
    return head_logits.float() / sampling.temperature, centroid_logits(head_logits.float()) / sampling.temperature


DraftDistribution = torch.Tensor | Callable[[], torch.Tensor]  # q (V,), or a function computing it when needed


def _draft(draft_dist: DraftDistribution) -> torch.Tensor:
    return (draft_dist() if callable(draft_dist) else draft_dist).float()


def js_accepts(head_logits: torch.Tensor, draft_dist: DraftDistribution, sampling: SamplingConfig,
               draft_logits: torch.Tensor | None = None) -> bool:
    """JS(q || c) <= max_i JS(p_i || c) with c = softmax of the mean head logits (Eqs. 5-6).

    First on the tokens where any of the distributions reaches a cut of :data:`JS_TAILS`, with the tail's mass
    bounding what it can add (:func:`_bounded_js_verdict`, :func:`~dropmatch.rules.divergence.js_bounds`):
    on the embedded pair's 262k vocabulary ~1-7k tokens stay. Where the bounds do not separate the two
    sides by more than the float32 noise of the full test, the full test decides, so the decision is
    the full test's. Under greedy decoding, ``draft_logits`` (V,), whose softmax is q, spare that test
    the draft's (V,) probabilities (a single-row softmax runs on one core: ~0.8 ms at 262k tokens).
    """
    logits, centroid = _tempered_logits(head_logits, sampling)
    centroid_is_mean = sampling.greedy or sampling.top_p == 1
    if draft_logits is not None and sampling.greedy:
        verdict = _bounded_js_verdict(logits, centroid, draft_logits.float(), centroid_is_mean, q_is_logits=True)
    else:
        draft_dist = _draft(draft_dist)
        verdict = _bounded_js_verdict(logits, centroid, draft_dist, centroid_is_mean)
    if verdict is not None:
        return verdict
    q = _draft(draft_dist)
    probs, centre = torch.softmax(logits, dim=-1), torch.softmax(centroid, dim=-1)
    return bool(js_divergence(q, centre) <= js_divergence(probs, centre).max())


def decide(criterion: str, head_logits: torch.Tensor, draft_token: int, draft_dist: DraftDistribution,
           sampling: SamplingConfig, uniforms: torch.Tensor | None = None, majority: str = "strict",
           vote_threshold: float | None = None, draft_logits: torch.Tensor | None = None) -> bool:
    """One DropMatch decision from the K head logits (K, V) at one position.

    ``draft_dist``: the draft distribution (V,), or a function returning it, called only if the JS
    test needs it (see :func:`js_accepts` for ``draft_logits``). Under sampling, pass ``vote_threshold``
    = u_j q(x) for the head votes of the module docstring; without it (legacy), heads vote with tokens
    sampled from ``uniforms`` (K,).
    """
    if criterion == "js":
        return js_accepts(head_logits, draft_dist, sampling, draft_logits)
    if sampling.greedy:
        tokens = argmax(head_logits)
        votes = tokens == draft_token
    elif vote_threshold is not None:
        votes, tokens = head_votes(head_logits, draft_token, sampling, vote_threshold), None
    else:
        tokens = head_tokens(head_logits, sampling, uniforms)
        votes = tokens == draft_token
    if _votes_decide(criterion, votes, tokens, draft_token, majority):
        return True
    return criterion == "js+majority" and js_accepts(head_logits, draft_dist, sampling, draft_logits)


# ---------------------------------------------------------------------------------------------
# Certified decisions on logits with bounded errors


def _g(t: torch.Tensor) -> torch.Tensor:
    """(e^t - 1) e^t + t: per unit of mass, the JS change for a log-probability error t."""
    return torch.expm1(t) * torch.exp(t) + t


def log_normalizer_bound(probs: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """Bound zeta on |log Z - log Z'| for a softmax a' = softmax(l') whose logits are off by at most
    ``err`` (nats, 0 on exact tokens): Z / Z' = sum_v a'_v e^{l_v - l'_v} lies in
    [1 + sum_v a'_v (e^{-err_v} - 1), 1 + sum_v a'_v (e^{err_v} - 1)]. ``probs`` a', ``err``: (..., V)
    (broadcast) -> (...)."""
    grow = torch.where(probs > 0, probs * torch.expm1(err), 0.0)  # inf past float32's range: no certificate
    up = torch.log1p(grow.sum(-1))
    down = -torch.log1p((probs * torch.expm1(-err)).sum(-1).clamp(min=-1 + 1e-7))
    return 1.01 * torch.maximum(up, down) + 1e-7  # slack for the float32 sums


def js_error_bound(a: torch.Tensor, b: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """Bound on |JS(a' || b') - JS(a || b)| when every log-probability of a and b at token v is off by
    at most ``eta_v``: ``a``, ``b`` the computed a', b' (..., V), ``eta`` (..., V) -> (...).

    From |a' - a| <= a (e^eta - 1), a |log(a/m)| <= a + b, and |log(a'/m') - log(a/m)| <= 2 eta:
    |dJS| <= sum_v (a'_v + b'_v) [(e^eta_v - 1) e^eta_v + eta_v].
    """
    mass = a + b
    return torch.where(mass > 0, mass * _g(eta), 0.0).sum(-1)  # inf past float32's range: no certificate


def certified_decide(criterion: str, heads: torch.Tensor, eps: torch.Tensor, exact: torch.Tensor, draft_token: int,
                     draft_dist: torch.Tensor | None, sampling: SamplingConfig, majority: str = "strict",
                     vote_threshold: float | None = None) -> bool | None:
    """The decision of :func:`decide` on the exact head logits, or ``None`` if the bounds cannot certify it.

    Args:
        heads: approximate head logits (K, V), exact on the tokens of ``exact`` (V,) bool.
        eps: bounds on |approx - exact| on the other tokens (nats): per head (K,), or per head and
            token (K, V).
        draft_dist: the draft distribution (V,); read by JS criteria only (``None`` for argmax votes).
    """
    err = (eps.reshape(eps.shape[0], -1) if eps.dim() else eps.reshape(1, 1)).expand_as(heads).masked_fill(exact, 0.0)
    if not sampling.greedy:
        if sampling.top_p < 1:
            return None  # top-p truncation is not continuous in the logits
        heads, err = heads / sampling.temperature, err / sampling.temperature
        sampling = SamplingConfig()  # the tempered softmax is the plain softmax of scaled logits
    need_js = criterion in JS_CRITERIA
    probs = torch.softmax(heads, dim=-1) if (need_js or vote_threshold is not None) else None
    if criterion != "js":
        if vote_threshold is None:  # argmax votes: certified if the top is exact and out of reach
            top_exact = heads.masked_fill(~exact, -math.inf).max(-1)
            top_other = (heads + err).masked_fill(exact, -math.inf).amax(-1)
            if bool((top_exact.values <= top_other).any()):
                return None
            tokens = top_exact.indices
            votes = tokens == draft_token
        else:
            eta = log_normalizer_bound(probs, err) + err[:, draft_token]
            p_x = probs[:, draft_token]
            yes, no = p_x * torch.exp(-eta) > vote_threshold, p_x * torch.exp(eta) <= vote_threshold
            if not bool((yes | no).all()):
                return None
            votes, tokens = yes, None
        if _votes_decide(criterion, votes, tokens, draft_token, majority):
            return True
        if criterion != "js+majority":
            return False
    err_c = err.mean(0)  # the centroid's logits are the heads' mean
    centroid = torch.softmax(centroid_logits(heads), dim=-1)
    draft_js, radii = js_divergence(draft_dist, centroid), js_divergence(probs, centroid)
    eta_c = log_normalizer_bound(centroid, err_c) + err_c  # (V,)
    eta_h = log_normalizer_bound(probs, err).unsqueeze(-1) + err  # (K, V)
    radius_err = js_error_bound(probs, centroid, torch.maximum(eta_h, eta_c))
    draft_err = js_error_bound(draft_dist.float(), centroid, eta_c)  # the draft distribution is exact
    if draft_js + draft_err + JS_SLACK <= (radii - radius_err).max() - JS_SLACK:
        return True
    if draft_js - draft_err - JS_SLACK > (radii + radius_err).max() + JS_SLACK:
        return False
    return None


MIN_GATHERED = 4096  # kept tokens always made exact by a gather (on a small vocabulary: all of them)
NORMALIZER_NOISE = 1e-5  # relative float32 rounding allowed in a normalizer summed over the vocabulary


def _normalizer_interval(exact_kept: torch.Tensor, approx_kept: torch.Tensor, log_z_approx: torch.Tensor,
                         err: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds on ln Z of rows whose logits are exact on the kept tokens and off by at most ``err`` (...,)
    nats elsewhere: ``exact_kept``, ``approx_kept`` (..., m) the exact and computed logits of the kept
    tokens, ``log_z_approx`` (...,) float64 the computed logits' ln Z. Returns (lo, hi, tail): ln Z in
    [lo, hi] and the mass off the kept tokens at most ``tail``, (...,) float64 each.

    Off the kept tokens the computed mass is Z~ - sum_kept e^{l~}; each of its terms is within a factor
    e^{+-err} of the exact one (and the float32 sum Z~ within :data:`NORMALIZER_NOISE` of its value)."""
    shift = log_z_approx.unsqueeze(-1)
    kept = (exact_kept.double() - shift).exp().sum(-1)  # in units of Z~
    tail = 1.0 - (approx_kept.double() - shift).exp().sum(-1)
    err = err.double()
    tail_hi = (tail + NORMALIZER_NOISE).clamp(min=0.0) * err.exp()
    tail_lo = (tail - NORMALIZER_NOISE).clamp(min=0.0) * (-err).exp()
    return (log_z_approx + (kept + tail_lo).log(), log_z_approx + (kept + tail_hi).log(),
            tail_hi / (kept + tail_hi))


def _shift_sensitivity(a: torch.Tensor, b: torch.Tensor, eta_a: torch.Tensor, eta_b: torch.Tensor) -> torch.Tensor:
    """Bound on how far the kept part of JS(a || b) (:func:`~dropmatch.rules.divergence.js_bounds`) moves
    when every log-probability of ``a`` (..., m) shifts by one amount within +-``eta_a`` (...,) and every
    one of ``b`` (m,) by one within +-``eta_b``: a normalizer error, not a per-token one.

    The kept part's derivative in a's shift is sum_v a'_v ln(a'_v / m'_v) / 2, and
    |ln(a'/m') - ln(a/m)| <= eta_a + eta_b along the way (m = (a + b) / 2); so the change is at most
    eta_a e^{eta_a} / 2 sum_v a_v (|ln(a_v / m_v)| + eta_a + eta_b), and the same for b. Near-equal
    distributions move little (ln(a/m) ~ 0), where the per-token bound of :func:`js_error_bound` charges
    ~3 eta for each unit of mass."""
    eta_a, eta_b = eta_a.double().unsqueeze(-1), torch.as_tensor(eta_b, dtype=torch.float64)
    mid = 0.5 * (a + b)
    both = eta_a + eta_b

    def side(p: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
        spread = torch.where(p > 0, p * ((p / mid).log().abs() + both), 0.0).sum(-1, keepdim=True)
        return (0.5 * eta * eta.exp() * spread).squeeze(-1)

    return side(a, eta_a) + side(b.expand_as(a), eta_b)


def _gather_limit(vocab: int) -> float:
    """Most tokens worth making exact by a gather: beyond it the exact heads over the whole vocabulary cost less."""
    return max(JS_MAX_KEPT * vocab, MIN_GATHERED)


def exact_argmaxes(approx: torch.Tensor, err: torch.Tensor, exact_on: Callable[[torch.Tensor], torch.Tensor],
                   head_max: torch.Tensor) -> torch.Tensor | None:
    """Each head's exact argmax (K,) from computed logits ``approx`` (K, V) off by at most ``err`` (K,) nats
    (``head_max`` (V,): their maximum over the heads): the first maximum of the exact logits of the tokens
    within twice its error of the head's computed top (no other token can reach the top token's exact
    logit), or ``None`` if there are too many of them."""
    reach = float((approx.amax(-1).double() - 2 * err).min()) - 1e-3  # the 1e-3: float32 rounding of the threshold
    tokens = indices_at_least(head_max, reach)
    if tokens.numel() > _gather_limit(approx.shape[-1]):
        return None
    return tokens[exact_on(tokens).argmax(-1)]  # tokens ascend, so ties go to the first, as over the vocabulary


def _head_max(approx: torch.Tensor) -> torch.Tensor:
    """The heads' largest computed logit at each token: (K, V) -> (V,)."""
    return approx.amax(0) if approx.shape[0] > 1 else approx[0]


def _head_statistics(approx: torch.Tensor, draft_logits: torch.Tensor | None, statistics: HeadStatistics | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """What :func:`tail_certified_decide` reads of the whole vocabulary: the heads' ln Z (K,) float64, the
    centroid's logits (V,) and ln Z (float64), the draft's ln Z (0.0 without ``draft_logits``) and the heads'
    maximum (V,). From ``statistics`` where the heads came with them (the draft's ln Z in torch if they came
    without it), else on CPUs in one pass of :func:`~dropmatch.kernels.head_statistics` where it runs (embedded
    pair, K = 5, caches as a verify step leaves them, 2-core AMX Xeon: ~1.0 against ~1.5 ms), else in torch."""
    k = approx.shape[0]
    if statistics is None:
        statistics = head_statistics(approx, draft_logits)
    draft_sum = statistics.sums[k + 1] if statistics is not None and statistics.sums.numel() > k + 1 else None
    log_zq = float(_log_normalizers(draft_logits, draft_sum)) if draft_logits is not None else 0.0
    if statistics is None:
        centroid = centroid_logits(approx)
        return _log_normalizers(approx), centroid, _log_normalizers(centroid), log_zq, _head_max(approx)
    sums = statistics.sums
    return (_log_normalizers(approx, sums[:k]), statistics.centroid, _log_normalizers(statistics.centroid, sums[k]),
            log_zq, statistics.head_max)


def tail_certified_decide(criterion: str, approx: torch.Tensor, err: torch.Tensor,
                          exact_on: Callable[[torch.Tensor], torch.Tensor], draft_token: int,
                          q: torch.Tensor, q_is_logits: bool, majority: str = "strict",
                          statistics: HeadStatistics | None = None) -> bool | None:
    """The greedy decision of :func:`decide` on exact head logits, from computed ones, or ``None`` if the
    bounds do not settle it.

    Args:
        approx: computed head logits (K, V), each off by at most its head's ``err`` (K,) nats.
        exact_on: tokens (m,) -> the exact head logits there (K, m), for the few tokens that matter.
        q: the draft distribution (V,), exact, or its logits (``q_is_logits``), whose float32 normalizer is
            charged :data:`NORMALIZER_NOISE` (read by JS criteria only).
        statistics: the centroid, maximum and exponential sums of ``approx`` where its heads came with them
            (:meth:`~dropmatch.heads.dropout.DropoutHead.summarized_logits`); else computed here.

    Votes are the heads' exact argmaxes (for js+majority from the JS test's gather where it holds every
    token that could be one, else :func:`exact_argmaxes`). The JS test is :func:`_bounded_js_verdict`'s
    on a kept set of tokens made exact: the heads', the centroid's and the draft's likely tokens. What
    the computed logits leave uncertain is then only each normalizer (:func:`_normalizer_interval`: the
    rest of the vocabulary is a small mass known within e^{+-err}), whose effect on the kept JS terms
    :func:`_shift_sensitivity` bounds; the mass off the kept tokens enters as in
    :func:`~dropmatch.rules.divergence.js_bounds`. Unlike :func:`certified_decide`, no per-token bound
    over the vocabulary is formed and the vocabulary is read a few times, so a decision on screened or
    bfloat16 logits costs little more than on exact ones.
    """
    if criterion not in JS_CRITERIA:
        tokens = exact_argmaxes(approx, err, exact_on, _head_max(approx))
        return None if tokens is None else _votes_decide(criterion, tokens == draft_token, tokens, draft_token, majority)
    votes_pending = criterion == "js+majority"
    err = err.double()
    log_z, centroid, log_zc, log_zq, head_max = _head_statistics(approx, q if q_is_logits else None, statistics)
    eta_q = torch.tensor(NORMALIZER_NOISE if q_is_logits else 0.0, dtype=torch.float64)  # ln Z from a float32 sum
    draft_total = 1.0 if q_is_logits else float(q.sum(dtype=torch.float64))
    top_log_prob = None
    lowest = min(float(log_z.min()), float(log_zc))
    # Kept at a cut: the tokens where a head's distribution, the centroid's or the draft's reaches it; any superset
    # gives valid bounds, and a larger one tighter bounds at the cost of its gather. One threshold on the heads'
    # largest logit, at the lowest ln Z (which also covers the centroid, the heads' mean); the draft's
    # log-probabilities ride in the same array, shifted by that ln Z, so each cut is one comparison and one pick
    # (ascending; natively one pass over both arrays, :func:`~dropmatch.kernels.kept_tokens`). Where the heads' ln Z
    # lie apart that keeps far more (p_drop 0.3: up to 26k tokens at 1e-3, against at most 1k a distribution), and
    # past SHARED_CUT_MAX_KEPT tokens each head's log-probabilities are cut on their own. The tokens of earlier cuts
    # stay.
    shift, limit = lowest - log_zq, min(SHARED_CUT_MAX_KEPT, math.floor(_gather_limit(approx.shape[-1])))
    draft_shifted = functools.cache(lambda: q + shift if q_is_logits else q.log().add_(lowest))  # torch's, as needed
    reach = functools.cache(lambda: torch.maximum(head_max, draft_shifted()))
    tokens = torch.empty(0, dtype=torch.long, device=approx.device)  # made exact so far, and their exact logits
    exact = torch.empty((approx.shape[0], 0), dtype=torch.float64, device=approx.device)
    for tail in GATHERED_JS_TAILS:
        cut = math.log(tail)
        kept = kept_tokens(head_max, q, shift, lowest + cut, limit) if q_is_logits else None
        if kept is None:
            kept = indices_at_least(reach(), lowest + cut)
        head_floors = lowest + cut
        if kept.numel() > limit:
            if top_log_prob is None:
                top_log_prob = torch.sub(approx, log_z.to(approx.dtype).unsqueeze(-1)).amax(0)
            kept = true_indices((top_log_prob >= cut).logical_or_(centroid >= float(log_zc) + cut)
                                .logical_or_(draft_shifted() >= lowest + cut))
            head_floors = log_z + cut
        if kept.numel() == 0:  # every distribution flat below this cut
            continue
        new = kept[~torch.isin(kept, tokens)] if tokens.numel() else kept  # each token made exact once
        if tokens.numel() + new.numel() > _gather_limit(approx.shape[-1]):
            return None
        tokens, exact = torch.cat([tokens, new]), torch.cat([exact, exact_on(new).double()], -1)  # (m,), (K, m)
        if votes_pending:  # the heads' argmaxes, from the first gather (ascending tokens) where it holds them
            votes_pending = False
            top = exact.argmax(-1)  # first maxima: tokens ascend, as over the vocabulary
            # head k's true argmax t has approx_t >= exact top - err: kept if that clears head k's threshold
            # (the 1e-3: float32 rounding of the threshold and of the computed log-probabilities)
            if bool((exact.gather(-1, top.unsqueeze(-1)).squeeze(-1) - err >= head_floors + 1e-3).all()):
                argmaxes = tokens[top]
            else:
                argmaxes = exact_argmaxes(approx, err, exact_on, head_max)
                if argmaxes is None:
                    return None
            if _votes_decide(criterion, argmaxes == draft_token, argmaxes, draft_token, majority):
                return True
        # the K heads and the centroid (row K), whose logits are the heads' mean, in one interval
        with_centre = torch.cat([exact, exact.mean(0, keepdim=True)])
        computed = torch.cat([approx.index_select(-1, tokens), centroid.index_select(-1, tokens).unsqueeze(0)])
        lo, hi, tails = _normalizer_interval(with_centre, computed, torch.cat([log_z, log_zc.reshape(1)]),
                                             torch.cat([err, err.mean().reshape(1)]))
        eta = 0.5 * (hi - lo)
        probs = (with_centre - (0.5 * (lo + hi)).unsqueeze(-1)).exp()
        centre, centre_tail, eta_c = probs[-1], float(tails[-1]), eta[-1]
        draft = q.index_select(-1, tokens).double()
        draft = (draft - log_zq).exp() if q_is_logits else draft
        draft_tail = max(0.0, draft_total - float(draft.sum()) * math.exp(-float(eta_q)))
        # against the centroid: the K heads (the radius) and the draft (last row), in one pass each
        sides = torch.cat([probs[:-1], draft.unsqueeze(0)])
        js_lo, js_hi = js_bounds(sides, centre, torch.cat([tails[:-1], tails.new_tensor([draft_tail])]), centre_tail)
        js_err = _shift_sensitivity(sides, centre, torch.cat([eta[:-1], eta_q.reshape(1)]), eta_c)  # symmetric
        radius_lo, radius_hi, radius_err = js_lo[:-1], js_hi[:-1], js_err[:-1]
        if float(js_hi[-1] + js_err[-1]) + JS_SLACK <= float((radius_lo - radius_err).max()) - JS_SLACK:
            return True
        if float(js_lo[-1] - js_err[-1]) - JS_SLACK > float((radius_hi + radius_err).max()) + JS_SLACK:
            return False
    return None


EIGHT_BIT_MAX_DROPPED = 2.0
# a rows head's greedy JS criteria take sparse heads with 8-bit corrections while K p_drop is at most this:
# the bags then read at most 2 x d columns of W in 8 bits, half the float32 rows' bytes. Measured at K p_drop
# = 1.5 (embedded pair, p_drop 0.3, js+majority, 35 recorded steps replayed, 2-core AMX Xeon): 26.4-26.7
# against 32.7-33.2 ms a step over the standard rule (6 of 72 positions recomputed on float32 rows); argmax
# votes keep the bfloat16 rows, which read less than the bags and certify at a glance. Where oneDNN's int8
# GEMM runs, the corrections past K p_drop 0.5 are one int8 pass over W instead (168 MB, ~8.5 ms a position
# on the embedded pair; see ``dropout.INT8_GEMM_MIN_DROPPED``), and the limit is kept where bags measured it.
# Both serve the positions whose rows did not ride in the verification GEMM (:meth:`DropMatch.fuses`: by default
# every position of a greedy step whose clean logits are screened).


@dataclass
class DropMatchCounters:
    """What the exactness machinery did (for profiles): evaluated positions, exact fallbacks, refined tokens."""

    evaluations: int = 0
    exact_fallbacks: int = 0
    refined_tokens: int = 0
    by_path: dict = field(default_factory=dict)


class DropMatch:
    """The DropMatch criterion: K dropout heads computed only at the positions it is asked about.

    All randomness of a step (the K x L x d masks) is fixed up front: their generator's seed (under sampling
    a hash of the step generator's state, so that the standard rule's stream is the one standard
    speculative sampling sees: same seed, same uniforms), from which position j's masks are the (j + 1)-th draw,
    made when first asked for (:class:`~dropmatch.heads.dropout.StepMasks`: a step that exact matching decides
    alone draws none). So the decisions do not depend on which positions are evaluated: computing every head
    at every position gives the same decisions (tested).

    Cost: on the dense path a head GEMM is one pass over the whole LM-head weight (335 MB in bfloat16
    on the embedded pair), and extra rows in a pass cost far less than a second pass; so the dropout
    rows of the first ``prefetch`` positions (default: all L) ride in the verification GEMM itself
    (:meth:`prefetch`). On the sparse path (small p_drop, see :class:`~dropmatch.heads.dropout.DropoutHead`)
    nothing is prefetched: a position's K heads cost the gathered dropped columns only, computed one
    position at a time where they are needed. On the rows path (CPUs with oneDNN, large K p_drop) greedy
    steps with screened clean logits prefetch the heads' own bfloat16 rows (:meth:`fuses`); elsewhere
    a position's K heads are one K-row pass, computed where needed: exact float32, whose decisions need no
    certification, or bfloat16 for greedy argmax votes on CPUs with native bfloat16 (:meth:`rows_dtype`),
    certified or recomputed in float32; greedy JS criteria take sparse heads with 8-bit corrections there
    instead (:meth:`heads_for`). Prefetched products are taken up one position at a time, where a criterion
    asks. The criteria (argmaxes, JS) run only where the standard rule rejects, until DropMatch rejects.

    Args:
        head: the K dropout heads.
        criterion, majority: see the module docstring.
        prefetch: positions whose rows ride in the verification GEMM (:meth:`fuses`) / are computed together
            on the dense path.
        refine_margin: under sampling, nats beyond twice the error bound within which tokens are made
            exact for JS.
        escalation: under sampling, extra margins (nats) tried in turn when a decision is not certified; each makes more
            tokens exact (a gather of their rows), far cheaper than the K-row float32 head pass that
            follows when none certifies.
        max_refined: above this many tokens to make exact, the heads are recomputed exactly.
        screened_clean_logits: whether greedy verify steps may hand over screened clean logits
            (:attr:`screened_logits_ok`); ``None``: yes.
    """

    def __init__(self, head: DropoutHead, criterion: str = "js+majority", majority: str = "strict",
                 prefetch: int = 16, refine_margin: float = 10.0,
                 escalation: tuple[float, ...] = (0.0, 5.0), max_refined: int = 65536,
                 screened_clean_logits: bool | None = None):
        check_criterion_args(criterion, majority)
        self.head, self.criterion, self.majority = head, criterion, majority
        self.screened_clean_logits = screened_clean_logits
        self.prefetch_positions = max(1, prefetch)
        self.name = f"dropmatch-{criterion}"
        self.refine_margin, self.escalation, self.max_refined = refine_margin, escalation, max_refined
        self.counters = DropMatchCounters()
        self._sparse_twin: DropoutHead | None = None  # a rows head's sparse heads for greedy JS criteria

    @property
    def screened_logits_ok(self) -> bool:
        """Whether greedy steps may give screened clean logits (decisions stay exact either way: they
        are certified). Yes unless told otherwise: exact-row heads never read the clean logits, dense
        bfloat16 heads ride in the screened GEMM, and sparse heads certify on them at little cost
        (:func:`tail_certified_decide`; embedded pair, 2-core AMX Xeon: the float32 head costs 12.8-14.6 ms
        a verify step more than the screened one; js+majority's certified decision at p_drop = 0.032,
        K = 5, ~2.8 ms a position with heads)."""
        if self.screened_clean_logits is not None:
            return self.screened_clean_logits
        return True

    def rows_dtype(self, sampling: SamplingConfig) -> torch.dtype:
        """The dtype of the rows path's K-row GEMM (:attr:`DropoutHead.exact_rows`): the head's own
        (bfloat16 on native-bfloat16 CPUs) for greedy argmax votes, which certify at a glance; the weight's
        (exact) for JS criteria and under sampling, whose certificates cost more than the bfloat16 pass
        saves (embedded pair, p_drop = 0.3, K = 5, 2-core AMX Xeon: js+majority 61 ms a position on
        bfloat16 rows against 31 ms on float32 rows)."""
        if sampling.greedy and self.criterion not in JS_CRITERIA:
            return self.head.rows_dtype
        return self.head.weight.dtype

    def corrections_dtype(self, sampling: SamplingConfig) -> torch.dtype:
        """The dtype of the sparse path's corrections: the head's :attr:`~DropoutHead.sparse_dtype` under
        greedy decoding, whose decisions certify on one bound per head (8-bit columns on x86 CPUs, else
        bfloat16 where native), else its compute dtype (float32 on the CPU default: per-token certificates
        under sampling cost more than the smaller read saves, and under top-p they do not exist)."""
        return self.head.sparse_dtype if sampling.greedy else self.head.compute_dtype

    def heads_dtype(self, sampling: SamplingConfig) -> torch.dtype:
        """The dtype of the GEMM that gives the K heads under ``sampling``: the head's compute dtype where they
        ride in the verification GEMM (:meth:`fuses`), :meth:`rows_dtype` on the rows path,
        :meth:`corrections_dtype` on the sparse path, else the head's compute dtype."""
        if self.fuses(sampling):
            return self.head.compute_dtype
        if self._takes_sparse_twin(sampling) or self.head.sparse:
            return self.corrections_dtype(sampling)
        return self.rows_dtype(sampling) if self.head.exact_rows else self.head.compute_dtype

    def _takes_sparse_twin(self, sampling: SamplingConfig) -> bool:
        """Whether :meth:`heads_for` gives the sparse twin (without building it)."""
        head = self.head
        if not (sampling.greedy and head.exact_rows and not head.softcap and head.sparse_dtype == BYTE_ROWWISE
                and head.k * head.p_drop <= EIGHT_BIT_MAX_DROPPED):
            return False
        # argmax votes too where the rows are float32 and the 8-bit corrections fast (native or one int8 GEMM)
        fast_corrections = native_kernels_available() or head.corrections_by_gemm
        return self.criterion in JS_CRITERIA or (head.rows_dtype == head.weight.dtype and fast_corrections)

    def heads_for(self, sampling: SamplingConfig) -> DropoutHead:
        """The dropout heads that compute the K heads of a position whose rows did not ride in the verification
        GEMM (:meth:`fuses`) under ``sampling``: :attr:`head`, except that on a
        rows head (:attr:`DropoutHead.exact_rows`) greedy JS criteria take a sparse twin on the same weight with
        8-bit corrections (its :attr:`~DropoutHead.sparse_dtype`) while K p_drop <= :data:`EIGHT_BIT_MAX_DROPPED`,
        and so do argmax votes where the rows are float32 (no native bfloat16) and the corrections are fast: the
        native :func:`~dropmatch.kernels.byte_column_sums` or one int8 GEMM (embedded pair, p_drop 0.3, K = 5,
        2-core AVX2 EPYC, `make bench-dropmatch`: naive's head + rule 19.9 against 39.8 ms a position on
        float32 rows). Its decisions are certified as any sparse head's, and recomputed on the rows head's exact
        rows where not."""
        head = self.head
        if not self._takes_sparse_twin(sampling):
            return head
        if self._sparse_twin is None:
            self._sparse_twin = DropoutHead(head.weight, head.k, head.p_drop, compute_dtype=torch.float32, sparse=True,
                                            sparse_dtype=BYTE_ROWWISE, vocab_block=head.vocab_block)
        self._sparse_twin.drop_stale_copies()  # its masks are the rows head's, which checks its own copies
        return self._sparse_twin

    def draw(self, inp: VerifyInput) -> StepMasks:
        """Masks (L, K, d) of the step (from the prefetch, or seeded now from the step generator), drawn as asked."""
        if inp.prefetch is not None:
            return inp.prefetch.state
        return self.head.step_masks(inp.n_draft, inp.generator, consume=inp.sampling.greedy)

    def prefetch(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Prefetch:
        """Seed the step's masks now and, where the heads ride in the verification GEMM (:meth:`fuses`), ask
        for the first ``prefetch`` positions' rows (``hidden``: the L + 1 positions)."""
        masks = self.head.step_masks(hidden.shape[0] - 1, generator, consume=sampling.greedy)
        n = min(self.prefetch_positions, len(masks))
        if not (n and self.fuses(sampling)):
            rows = None
        elif self.head.exact_rows:  # the heads' own inputs: their products are the heads
            rows = self.head.row_inputs(hidden[:n], masks[:n], torch.bfloat16)
        else:  # the perturbations: their products are added to the clean logits
            rows = self.head.perturbation_inputs(hidden[:n], masks[:n])
        return Prefetch(rows, masks)

    def fuses(self, sampling: SamplingConfig) -> bool:
        """Whether the step's heads ride in the verification GEMM as bfloat16 rows (the screened head's dtype;
        :meth:`prefetch`): the dense path's perturbation rows always; on a rows head (:attr:`DropoutHead.exact_rows`)
        its bfloat16 rows, the heads' own inputs, under greedy decoding where its rows are bfloat16 and the clean
        logits screened, for every criterion. There the K rows of all L positions cost one GEMM's few extra rows
        (embedded pair, p_drop 0.3, 2-core AMX Xeon: 6 + 25 rows take ~3-4.5 ms more than 6, where a position's
        heads took ~7.4 ms as one int8 GEMM or ~14 ms as a pass of their own), and the decisions are certified
        on one bound per head, as on bfloat16 rows."""
        head = self.head
        if head.softcap or head.sparse or head.compute_dtype != torch.bfloat16:
            return False
        if not head.exact_rows:
            return True
        return sampling.greedy and head.rows_dtype == torch.bfloat16 and self.screened_logits_ok

    def _clean_bounds(self, inp: VerifyInput, rows: slice) -> torch.Tensor | None:
        """Bounds on the error of the clean logits at ``rows`` when they are screened
        (:attr:`VerifyInput.logits_screened`): one per row (n, 1) under greedy decoding, where
        :func:`tail_certified_decide` reads no more, else per token (n, V); ``None`` when they are float32
        (or unused: soft-capping)."""
        if not inp.logits_screened or self.head.softcap:
            return None
        if inp.sampling.greedy:
            return self.head.screened_clean_bound_max(inp.hidden[rows], inp.target_logits[rows])
        return self.head.screened_clean_bounds(inp.hidden[rows], inp.target_logits[rows])

    def _vote_thresholds(self, inp: VerifyInput) -> list[float] | None:
        """u_j q_j(x_j) per position under sampling, with the standard rule's uniforms (read from a
        copy of the step generator: the standard rule draws them right after ``prepare``)."""
        if inp.sampling.greedy:
            return None
        peek = torch.Generator()
        peek.set_state(inp.generator.get_state())
        uniforms = torch.rand(inp.n_draft + 1, generator=peek)
        return (uniforms[: inp.n_draft] * inp.draft_token_probs()).tolist()

    def prepare(self, inp: VerifyInput) -> PositionTest:
        if self.head.p_drop == 0:
            return self._standard
        masks = self.draw(inp)
        thresholds = self._vote_thresholds(inp)
        heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        statistics: dict[int, HeadStatistics] = {}  # of the sparse heads a greedy JS decision reads
        fused = inp.prefetch.products if inp.prefetch is not None else None
        n_fused = 0 if fused is None else fused.shape[0] // self.head.k

        def compute(rows: slice, products: torch.Tensor | None) -> None:
            # a position whose rows did not ride in the GEMM takes heads_for's heads (asked only then: on a rows
            # head that builds a sparse twin, which fused steps never need)
            head = self.head if products is not None else self.heads_for(inp.sampling)
            if head.exact_rows:  # the heads directly (their rows fused or a pass of their own): exact, or bounded per head
                logits, bounds = head.row_logits(inp.hidden[rows], masks[rows], self.rows_dtype(inp.sampling),
                                                 products=products)
                heads.update({rows.start + i: (logits[i], bounds[i].unsqueeze(-1)) for i in range(logits.shape[0])})
                return
            dtype = self.corrections_dtype(inp.sampling)
            if products is None and inp.sampling.greedy and self.criterion in JS_CRITERIA and rows.stop - rows.start == 1:
                logits, summary = head.summarized_logits(inp.hidden[rows], inp.target_logits[rows], masks[rows], dtype,
                                                         inp.draft_logits_at(rows.start))
                if summary is not None:
                    statistics[rows.start] = summary
            else:
                logits = head.logits(inp.hidden[rows], inp.target_logits[rows], masks[rows], products, dtype)
            from_gemm = products is not None
            prod = head.product_bounds(inp.hidden[rows], masks[rows], inp.target_logits[rows], logits, from_gemm,
                                       read_outputs=not inp.sampling.greedy, sparse_dtype=dtype)  # greedy: one bound per head
            clean = self._clean_bounds(inp, rows)  # (n, V) or None
            scale = head.error_scale(from_gemm)
            for i in range(logits.shape[0]):  # eps (K, V) or (K, 1): bounds on each head logit's error
                eps = prod[i].unsqueeze(-1) + (0.0 if clean is None else clean[i])
                heads[rows.start + i] = (logits[i], scale * eps)

        def test(j: int) -> bool:
            if j not in heads and j < n_fused:  # its products came with the clean logits; taken up where asked
                compute(slice(j, j + 1), fused[j * self.head.k : (j + 1) * self.head.k])
            if j not in heads:
                # Dense: the GEMM reads the whole head weight; a few more rows cost almost nothing, so
                # the next ``prefetch - 1`` positions come with this one. Sparse: one position.
                unfused = self.heads_for(inp.sampling)
                span = 1 if (unfused.sparse or unfused.exact_rows) else self.prefetch_positions
                compute(slice(j, min(j + span, inp.n_draft)), None)
            self.counters.evaluations += 1
            logits, eps = heads[j]
            x = int(inp.draft_tokens[j])
            threshold = None if thresholds is None else thresholds[j]
            bound = float(eps.max())
            if bound != 0:  # inexact heads; a bound that is not finite certifies nothing
                if not math.isfinite(bound):
                    verdict = None
                elif inp.sampling.greedy:
                    verdict = self._tail_certified(j, logits, eps, x, inp, masks, statistics.get(j))
                else:
                    verdict = self._escalated(j, logits, eps, x, inp, masks, threshold)
                if verdict is not None:
                    return verdict
                self.counters.exact_fallbacks += 1
                logits = self.head.exact_logits(inp.hidden[j : j + 1], masks[j : j + 1])[0]
            return decide(self.criterion, logits, x, lambda: inp.draft_distribution(j), inp.sampling, None,
                          self.majority, threshold, inp.draft_logits_at(j))

        return test

    def _standard(self, j: int) -> bool:
        """The test at p_drop = 0: every head is the target, so the JS radius is 0 and every vote the
        target's; nothing standard verification rejects is accepted. (Computed, the centroid of K equal
        rows and the JS sums carry float32 noise of ~1e-8 nats, which accepted drafts within ~1e-4 nats of
        the target, and a tie rounded two ways could swing the votes.)"""
        self.counters.evaluations += 1
        return False

    def _tail_certified(self, j: int, logits: torch.Tensor, eps: torch.Tensor, x: int, inp: VerifyInput,
                        masks: StepMasks, summary: HeadStatistics | None = None) -> bool | None:
        """:func:`tail_certified_decide` at position j (greedy decoding), its kept tokens made exact (``summary``:
        the heads' statistics where they came with them)."""
        def exact_on(tokens: torch.Tensor) -> torch.Tensor:
            self.counters.refined_tokens += int(tokens.numel())
            return self.head.exact_on(inp.hidden[j : j + 1], masks[j : j + 1], tokens)[0]

        draft_logits = inp.draft_logits_at(j)
        q = inp.draft_distribution(j) if draft_logits is None else draft_logits
        return tail_certified_decide(self.criterion, logits, eps.amax(-1), exact_on, x, q, draft_logits is not None,
                                     self.majority, summary)

    def _escalated(self, j: int, logits: torch.Tensor, eps: torch.Tensor, x: int, inp: VerifyInput,
                   masks: StepMasks, threshold: float | None) -> bool | None:
        """Under sampling: :meth:`_certified` with the exact set widened in turn by :attr:`escalation`
        (far cheaper than the K-row exact pass that follows when none certifies); ``None`` under top-p,
        whose cut is not continuous in the logits."""
        if inp.sampling.top_p < 1:
            return None
        q = inp.draft_distribution(j)
        for extra_margin in self.escalation:
            verdict = self._certified(j, logits, eps, x, q, inp, masks, threshold, extra_margin)
            if verdict is not None:
                return verdict
        return None

    def _certified(self, j: int, logits: torch.Tensor, eps: torch.Tensor, x: int, q: torch.Tensor,
                   inp: VerifyInput, masks: StepMasks, threshold: float | None,
                   extra_margin: float = 0.0) -> bool | None:
        """Under sampling (head votes by acceptance probability: every criterion reads masses): make the
        tokens near each head's top and the draft's likely tokens exact (within the refine margin +
        ``extra_margin`` nats), then :func:`certified_decide` (None: undecided)."""
        margin = 2 * float(eps.max()) + self.refine_margin + extra_margin
        near = (logits >= logits.amax(-1, keepdim=True) - margin).any(0)
        near |= q >= q.max() * math.exp(-margin)  # the draft's mass off the exact tokens enters the bounds
        near[x] = True
        tokens = near.nonzero().squeeze(-1)
        if tokens.numel() > self.max_refined:
            return None
        self.counters.refined_tokens += int(tokens.numel())
        logits = logits.clone()
        logits[:, tokens] = self.head.exact_on(inp.hidden[j : j + 1], masks[j : j + 1], tokens)[0]
        return certified_decide(self.criterion, logits, eps, near, x, q, inp.sampling, self.majority, threshold)
