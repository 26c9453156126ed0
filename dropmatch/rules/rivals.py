"""Training-free lossy acceptance criteria that DropMatch is compared with (ANCHORS.md, sec. 5).

Each is a :class:`~dropmatch.rules.base.Criterion`; wrap it in
:class:`~dropmatch.rules.standard.RelaxedVerification` to use it as a rule.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .base import PositionTest, VerifyInput
from .divergence import entropy, js_divergence, kl_divergence


class TopK:
    """Accept a draft token that is among the target's K most likely tokens (AutoJudge's baseline)."""

    def __init__(self, k: int = 2):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"top-K acceptance needs an integer K >= 1, got {k!r}")
        self.k = k
        self.name = f"topk-{k}"

    def prepare(self, inp: VerifyInput) -> PositionTest:
        logits = inp.target_logits[: inp.n_draft]
        top = logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices  # (L, K)
        # a token the target rules out (-inf, e.g. masked) is never accepted, even where fewer than K are possible
        possible = logits.gather(-1, inp.draft_tokens.view(-1, 1)).squeeze(-1) > -math.inf
        hits = ((top == inp.draft_tokens.unsqueeze(-1)).any(dim=-1) & possible).tolist()
        return lambda j: hits[j]


class TypicalAcceptance:
    """Medusa's typical acceptance: p(x) > min(eps, delta * exp(-H(p))).

    p is the target distribution at the run's temperature (untempered under greedy decoding).
    """

    def __init__(self, eps: float = 0.09, delta: float = 0.3):
        if not (0 < eps <= 1 and 0 < delta < math.inf):  # NaN fails both
            raise ConfigError(f"typical acceptance needs 0 < eps <= 1 and delta > 0, got {eps}, {delta}")
        self.eps, self.delta = eps, delta
        self.name = f"typical-{eps:g}-{delta:g}"

    def prepare(self, inp: VerifyInput) -> PositionTest:
        def test(j: int) -> bool:
            p = inp.sampling.probs(inp.target_logits[j])
            threshold = min(self.eps, self.delta * math.exp(-float(entropy(p))))
            return float(p[inp.draft_tokens[j]]) > threshold

        return test


class DivergenceThreshold:
    """Accept when the draft and target distributions at the position are close (Fuzzy SD, KL judge).

    ``metric`` is ``js`` (JS(q || p)) or ``kl`` (KL(q || p), finite for one-hot drafts).
    """

    METRICS = ("js", "kl")

    def __init__(self, metric: str = "js", threshold: float = 0.1):
        if metric not in self.METRICS:
            raise ConfigError(f"unknown divergence {metric!r}; choose js or kl")
        if not 0 <= threshold < math.inf:  # NaN too: it would never accept
            raise ConfigError(f"divergence threshold must be a finite number >= 0, got {threshold}")
        self.metric, self.threshold = metric, threshold
        self.name = f"divergence-{metric}-{threshold:g}"

    def prepare(self, inp: VerifyInput) -> PositionTest:
        divergence = js_divergence if self.metric == "js" else kl_divergence

        def test(j: int) -> bool:
            p = inp.sampling.probs(inp.target_logits[j])
            return float(divergence(inp.draft_distribution(j), p)) <= self.threshold

        return test
