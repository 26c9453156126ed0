"""How a verdict is reached: the thresholds, the paper's claims and our measurements, the rule.

Verdicts, tested in this order:

* ``not testable here``: the result needs what this setup lacks (a GPT-4 judge, Alpaca or LiveCodeBench
  data, vLLM on A100s), the series wrote no measurement, the measurement has no 95 % interval or rests on
  fewer than ``MIN_PROMPTS`` prompts, the lossless run's task score sits at the floor (below
  ``SCORE_FLOOR`` or above 1 - ``SCORE_FLOOR``), or the interval is too wide to tell (underpowered).
* ``different regime``: measured with dropout at a p_drop whose relative logit noise on our model differs
  from the paper's by more than a factor ``NOISE_RATIO_TOLERANCE`` (Var ~ p / ((1 - p) d), see
  :func:`~dropmatch.analysis.equal_noise_p_drop`: p_drop = 0.3 on the 640-wide Gemma-3-270M has 12.8
  times the noise of 0.3 on the 8192-wide 70B), or a result bound to model size (the head's share of the
  forward pass) on a model whose width differs by more than ``WIDTH_RATIO_TOLERANCE``. Every result
  measured with dropout gets two rows: at the paper's p_drop and at the equal-noise p_drop.
* ``reproduced`` / ``not reproduced``: our 95 % interval against the band, the paper's value or range
  widened by the claim's tolerance. An *effect* claim (the band excludes no effect, e.g. a speed-up of
  1.10 +- 0.05 against 1.0): reproduced when the interval meets the band and excludes no effect. A
  *level* claim (the band holds no effect or there is none: 98.4 % of positions agree): reproduced when
  the interval lies inside the band. Either: not reproduced when the interval misses the band (or, for an
  effect claim, reaches no further than no effect towards it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..paper import HIDDEN_SIZE, P_DROP
from ..report import Estimate

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
DIFFERENT_REGIME, NOT_TESTABLE = "different regime", "not testable here"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, DIFFERENT_REGIME, NOT_TESTABLE)

# --- thresholds (printed under the table by thresholds_text) ---------------------------------------
RATIO_TOLERANCE = 0.05
QUALITY_TOLERANCE_POINTS = 2.0
FIGURE_TOLERANCE_POINTS = 3.0
FIGURE_RATIO_TOLERANCE = 0.1
SHARE_TOLERANCE = 0.02
JS_RELATIVE_TOLERANCE = 0.5
OVERHEAD_TOLERANCE_POINTS = 1.0
KOMT_SCORE_TOLERANCE = 0.3
FIG3_HIGH_COSINE = 0.8
SCORE_FLOOR = 0.05
MIN_PROMPTS = 5
NOISE_RATIO_TOLERANCE = 1.5
WIDTH_RATIO_TOLERANCE = 1.5
P_MATCH_TOLERANCE = 0.1
THRESHOLDS = {
    "RATIO_TOLERANCE": "speed-up and tau ratios: the paper's value +- this",
    "QUALITY_TOLERANCE_POINTS": "accuracy changes (points): the paper's value +- this",
    "FIGURE_TOLERANCE_POINTS": "values read off a figure (points): +- this",
    "FIGURE_RATIO_TOLERANCE": "ratios of values read off a figure: +- this",
    "SHARE_TOLERANCE": "share of positions where all heads agree (Table 2): +- this",
    "JS_RELATIVE_TOLERANCE": "JS divergences (Table 3): +- this fraction of the paper's value",
    "OVERHEAD_TOLERANCE_POINTS": "head overhead (Table 4): at most the paper's percentage + this",
    "KOMT_SCORE_TOLERANCE": "LLM-judge score changes out of 10 (Table 10): +- this",
    "FIG3_HIGH_COSINE": "'high' path similarity (Fig. 3 prints no numbers): mean cosine at least this",
    "SCORE_FLOOR": "a lossless task score below this (or above 1 - this) cannot show a quality change",
    "MIN_PROMPTS": "fewer prompts than this give no usable bootstrap interval",
    "NOISE_RATIO_TOLERANCE": "same regime: relative logit-noise variance within this factor of the paper's",
    "WIDTH_RATIO_TOLERANCE": "size-bound results (Table 4): same regime when hidden sizes are within this factor",
    "P_MATCH_TOLERANCE": "a run at p counts for a wanted p_drop when p / (1 - p) is within this fraction of it",
}
PAPER_WIDTH = HIDDEN_SIZE["Llama-3.1-70B"]  # Llama-3.3-70B has the same width
P_DROP_REFERENCE = P_DROP  # notebook 07's p_equal is the equal-noise p_drop of 0.3 at PAPER_WIDTH


@dataclass(frozen=True)
class Claim:
    """One number of the paper: its value or range (``lo``-``hi``), tolerance (absolute, or relative with
    ``relative``), the no-effect value ``null`` and, for results measured with dropout, the paper's
    ``p_drop`` and target width. ``untestable`` says why no setup here can test it."""

    result: str
    comparison: str
    lo: float
    hi: float
    unit: str
    tolerance: float = 0.0
    relative: bool = False
    null: float | None = None
    kind: str = "auto"  # "effect", "level", or "auto": effect when the band excludes null
    p_drop: float | None = None
    width: int = PAPER_WIDTH
    scale_bound: bool = False
    text: str = ""
    setup: str = ""
    untestable: str = ""

    def band(self) -> tuple[float, float]:
        lo_tol = self.tolerance * abs(self.lo) if self.relative else self.tolerance
        hi_tol = self.tolerance * abs(self.hi) if self.relative else self.tolerance
        return self.lo - lo_tol, self.hi + hi_tol

    def is_effect(self) -> bool:
        if self.null is None or self.kind == "level":
            return False
        lo, hi = self.band()
        return self.kind == "effect" or not lo <= self.null <= hi

    def paper_text(self) -> str:
        return self.text or (fmt(self.lo) if self.lo == self.hi else f"{fmt(self.lo)}-{fmt(self.hi)}")


@dataclass(frozen=True)
class Measurement:
    """Our number for a claim: an estimate, the p_drop it was measured at (``None``: no dropout), why
    it is missing, and the answer agreement with the lossless run (quality rows)."""

    estimate: Estimate = field(default_factory=lambda: Estimate(float("nan")))
    p_drop: float | None = None
    missing: str = ""
    agreement: Estimate | None = None


def odds(p: float) -> float:
    return p / (1 - p)


def noise_ratio(p: float, claim: Claim, width: float) -> float:
    """Relative logit-noise variance at ``p`` on a model of hidden size ``width`` over the paper's."""
    return odds(p) / odds(claim.p_drop) * claim.width / width


def _within(ratio: float, factor: float) -> bool:
    return 1 / factor <= ratio <= factor


def verdict(claim: Claim, m: Measurement, width: float) -> tuple[str, str]:
    """(verdict, reason) of one measurement; ``width`` is our target's hidden size."""
    if claim.untestable:
        return NOT_TESTABLE, claim.untestable
    if m.missing:
        return NOT_TESTABLE, m.missing
    regime = ""
    if claim.p_drop is not None and m.p_drop is not None:
        ratio = noise_ratio(m.p_drop, claim, width)
        if not _within(ratio, NOISE_RATIO_TOLERANCE):
            regime = (f"at p_drop={m.p_drop:g} our relative logit-noise variance is {ratio:.3g}x the paper's at "
                      f"{claim.p_drop:g} (tolerance {NOISE_RATIO_TOLERANCE:g}x); see the equal-noise row")
    if claim.scale_bound and not _within(width / claim.width, WIDTH_RATIO_TOLERANCE):
        regime = "; ".join(filter(None, [regime, f"size-bound result: our target is {width / claim.width:.3g}x "
                                                  f"the paper's width ({width:g} vs {claim.width})"]))
    outcome, why = interval_test(claim, m.estimate)
    if regime:
        return DIFFERENT_REGIME, f"{regime}. The interval test alone: {outcome} ({why})"
    return outcome, why


def interval_test(claim: Claim, e: Estimate) -> tuple[str, str]:
    """The 95 % interval against the claim's band (module docstring)."""
    if not math.isfinite(e.value):
        return NOT_TESTABLE, f"no value ({e.source or 'not measured'})"
    if not (math.isfinite(e.lo) and math.isfinite(e.hi)):
        return NOT_TESTABLE, f"no 95 % interval: {e.source or 'none given'}"
    if e.n is not None and e.n < MIN_PROMPTS:
        return NOT_TESTABLE, f"only {e.n} prompts (MIN_PROMPTS = {MIN_PROMPTS})"
    lo, hi = claim.band()
    ci, band = f"95 % CI [{fmt(e.lo)}, {fmt(e.hi)}]", f"band [{fmt(lo)}, {fmt(hi)}]"
    if e.hi < lo or e.lo > hi:
        return NOT_REPRODUCED, f"{ci} {'below' if e.hi < lo else 'above'} the {band}"
    if claim.is_effect():
        towards_band = e.hi > claim.null if lo >= claim.null else e.lo < claim.null
        if not towards_band:
            return NOT_REPRODUCED, f"{ci} reaches no further than no effect ({fmt(claim.null)}) towards the {band}"
        if e.lo <= claim.null <= e.hi:
            return NOT_TESTABLE, f"underpowered: {ci} holds both the {band} and no effect ({fmt(claim.null)})"
        return REPRODUCED, f"{ci} meets the {band} and excludes no effect ({fmt(claim.null)})"
    if lo <= e.lo and e.hi <= hi:
        return REPRODUCED, f"{ci} inside the {band}"
    return NOT_TESTABLE, f"underpowered: {ci} meets the {band} but reaches beyond it"


def fmt(x: float | None) -> str:
    """A number for the tables: 4 significant digits below 0.1, else 3 decimals without trailing zeros."""
    if x is None or not math.isfinite(x):
        return "n/a" if x is None or math.isnan(x) else ("inf" if x > 0 else "-inf")
    if abs(x) < 0.1 and x != 0:
        return f"{x:.4g}"
    return f"{x:.3f}".rstrip("0").rstrip(".")


def ci_text(e: Estimate | None) -> str:
    """``value [lo, hi]``, the value alone without an interval, ``n/a`` without a value."""
    if e is None or not math.isfinite(e.value):
        return "n/a"
    if not (math.isfinite(e.lo) and math.isfinite(e.hi)):
        return fmt(e.value)
    return f"{fmt(e.value)} [{fmt(e.lo)}, {fmt(e.hi)}]"


def thresholds_text() -> str:
    """The thresholds the verdicts use, one markdown bullet each."""
    return "\n".join(f"- `{name} = {globals()[name]:g}`: {meaning}" for name, meaning in THRESHOLDS.items())


def rules_text() -> str:
    """How a verdict is reached (this module's docstring, from its list of verdicts on)."""
    return (__doc__ or "").split("Verdicts, tested in this order:")[-1].strip()
