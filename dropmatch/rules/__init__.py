"""Verification rules: pure tensor code that decides, per verify step, which draft tokens to keep.

* :mod:`.base`: what a rule sees (:class:`VerifyInput`) and returns (:class:`Verdict`), the protocols;
* :mod:`.standard`: lossless verification, and :class:`RelaxedVerification` for lossy criteria;
* :mod:`.dropmatch`: DropMatch's criteria on K dropout heads (naive / majority / js / js+majority);
* :mod:`.rivals`: top-K, typical acceptance, divergence thresholds;
* :mod:`.fly`: FLy (entropy gate + deferred window); :mod:`.ensemble`: static ensemble verification (DIVERSED);
* :mod:`.judge`: an AutoJudge-style trained classifier as a criterion; :mod:`.combine`: ``AnyOf``;
* :mod:`.divergence`: KL, JS and entropy.

Nothing here imports models, drafters, the engine or tasks (``tests/test_layout.py`` checks it).
"""

from .base import (
    Criterion,
    PositionTest,
    Prefetch,
    Prefetching,
    Verdict,
    VerificationRule,
    VerifyInput,
    exact_match_when_greedy,
    screened_logits_ok,
)
from .combine import AnyOf
from .dropmatch import CRITERIA, MAJORITY_RULES, DropMatch
from .ensemble import StaticEnsembleVerification
from .fly import FLyVerification
from .rivals import DivergenceThreshold, TopK, TypicalAcceptance
from .standard import RelaxedVerification, StandardVerification, exact_match_prefix

__all__ = [
    "CRITERIA", "MAJORITY_RULES", "AnyOf", "Criterion", "DivergenceThreshold", "DropMatch", "FLyVerification",
    "PositionTest", "Prefetch", "Prefetching", "RelaxedVerification", "StandardVerification",
    "StaticEnsembleVerification", "TopK", "TypicalAcceptance", "Verdict", "VerificationRule", "VerifyInput",
    "exact_match_prefix", "exact_match_when_greedy", "screened_logits_ok",
]
