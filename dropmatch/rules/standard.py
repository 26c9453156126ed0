"""The standard verification rule, and the relaxation every lossy criterion plugs into.

:class:`StandardVerification` is the lossless baseline: greedy exact match at temperature 0,
speculative sampling (accept with min(1, p/q), resample the residual, bonus from p) otherwise.
:class:`RelaxedVerification` adds a lossy acceptance criterion on top: where the standard rule
rejects, the criterion may still accept (DropMatch, top-K, typical acceptance, divergence
thresholds, a trained judge). The token emitted at the first rejected position, and the bonus token,
always come from the standard rule: the dropout-free argmax under greedy decoding, the
speculative-sampling correction under sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig, argmax, sample_with_uniform
from .base import Criterion, Prefetch, Prefetching, Verdict, VerifyInput, screened_logits_ok


@dataclass
class _Standard:
    """Per-step quantities of the standard rule."""

    accepts: torch.Tensor  # (L,) bool
    correction: Callable[[int], int]
    bonus: int


def _standard(inp: VerifyInput) -> _Standard:
    n = inp.n_draft
    draft = inp.draft_tokens
    if inp.sampling.greedy:
        tokens = argmax(inp.target_logits)  # (L + 1,)
        accepts, target_tokens = draft == tokens[:n], tokens.tolist()
        return _Standard(accepts.cpu(), lambda j: target_tokens[j], target_tokens[n])
    uniforms = torch.rand(n + 1, generator=inp.generator)
    p = inp.sampling.probs(inp.target_logits)  # (L + 1, V)
    rows = torch.arange(n, device=p.device)
    p_draft = p[rows, draft].cpu()
    accepts = uniforms[:n] * inp.draft_token_probs() < p_draft  # the q of the residual below, however given

    def correction(j: int) -> int:
        residual = (p[j] - inp.draft_distribution(j)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[j]
        return int(sample_with_uniform(residual, uniforms[n]))

    return _Standard(accepts, correction, int(sample_with_uniform(p[n], uniforms[n])))


def exact_match_prefix(draft_tokens: torch.Tensor, candidates: torch.Tensor, logits: torch.Tensor,
                       bounds: torch.Tensor) -> int:
    """How many draft tokens greedy exact matching could still keep, judged before the head runs: the
    first position where some candidate token certainly outscores the draft token, else all ``n``.

    At such a position the target's argmax is not the draft token, so the step keeps at most the tokens
    before it and emits that row's argmax: verifying the draft cut there, on rows ``0..k`` of the head,
    gives the same verdict as the whole draft. Certainly means beyond rounding: each logit lies within
    ``bounds`` of the exact product, as does any float32 evaluation of the head, so a candidate counts
    only where ``logit - 2 bound`` exceeds the draft token's ``logit + 2 bound``.

    Args:
        draft_tokens: (n,) int64.
        candidates: (m,) sorted distinct token ids, every draft token among them.
        logits, bounds: (n, m) float32, the candidates' logits at rows ``0..n-1`` and their error bounds.
    """
    n = draft_tokens.numel()
    if n == 0:
        return 0
    rows = torch.arange(n, device=logits.device)
    column = torch.searchsorted(candidates, draft_tokens)  # (n,) where each draft token sits
    ceiling = logits[rows, column] + 2 * bounds[rows, column]  # (n,) the draft token's highest possible logit
    beaten = (logits - 2 * bounds > ceiling[:, None]).any(dim=1)  # (n,)
    first = beaten.nonzero()
    return int(first[0]) if len(first) else n


class StandardVerification:
    """Lossless verification: greedy exact match, or speculative sampling when temperature > 0."""

    name = "standard"
    screened_logits_ok = True  # greedy: the argmax only, which screened logits give exactly
    exact_match_when_greedy = True  # greedy: rows past a certain rejection can be cut (exact_match_prefix)

    def verify(self, inp: VerifyInput) -> Verdict:
        std = _standard(inp)
        rejected = (~std.accepts).nonzero()
        if len(rejected) == 0:
            return Verdict(inp.n_draft, std.bonus)
        j = int(rejected[0])
        return Verdict(j, std.correction(j))


class RelaxedVerification:
    """Standard verification plus a lossy criterion at the positions the standard rule rejects.

    Args:
        criterion: the lossy test.
        keep_standard_accepts: accept every position the standard rule accepts (default). With
            ``False`` the criterion alone decides at every position (the paper-literal reading);
            under greedy decoding a draft token equal to the target argmax is still kept where the
            criterion rejects it, since the correction would emit that very token.
    """

    def __init__(self, criterion: Criterion, keep_standard_accepts: bool = True):
        self.criterion = criterion
        self.keep_standard_accepts = keep_standard_accepts
        self.name = criterion.name + ("" if keep_standard_accepts else "-literal")

    @property
    def screened_logits_ok(self) -> bool:
        """The criterion's say (the standard part needs the argmax only)."""
        return screened_logits_ok(self.criterion)

    def prefetch(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Prefetch | None:
        if isinstance(self.criterion, Prefetching):
            return self.criterion.prefetch(hidden, sampling, generator)
        return None

    def verify(self, inp: VerifyInput) -> Verdict:
        test = self.criterion.prepare(inp)  # first: the same draw order as when the engine prefetched
        std = _standard(inp)
        extra = evaluations = 0
        for j in range(inp.n_draft):
            standard_ok = bool(std.accepts[j])
            if standard_ok and self.keep_standard_accepts:
                continue
            evaluations += 1
            if test(j):
                extra += not standard_ok
                continue
            if standard_ok and inp.sampling.greedy:  # literal mode: the "correction" (the target argmax) is
                continue  # the draft token itself, so emitting it is an acceptance and the step goes on
            return Verdict(j, std.correction(j), extra, evaluations)
        return Verdict(inp.n_draft, std.bonus, extra, evaluations)
