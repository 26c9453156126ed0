"""The verdict table: every claim of the paper at each p_drop regime, and its CSV and markdown."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from ..analysis import equal_noise_p_drop
from ..report import Estimate
from . import claims
from .measure import at_p
from .rules import (
    P_DROP_REFERENCE,
    P_MATCH_TOLERANCE,
    PAPER_WIDTH,
    VERDICTS,
    Claim,
    Measurement,
    ci_text,
    odds,
    rules_text,
    thresholds_text,
    verdict,
)

RESULT_ORDER = ("Fig. 1a", "Fig. 1b", "Table 1", "Table 2", "Fig. 3", "Table 3", "Table 4", "Table 5", "Table 6",
                "Table 7", "Table 8", "Fig. 5", "Fig. 6", "Table 9", "Table 10")
COLUMNS = ["result", "comparison", "regime", "p_drop", "unit", "paper", "paper_lo", "paper_hi", "band_lo", "band_hi",
           "ours", "ours_lo", "ours_hi", "n", "verdict", "reason", "agreement", "agreement_lo", "agreement_hi",
           "source", "paper setup", "our setup"]
PAPER_P, EQUAL_NOISE, NO_DROPOUT = "paper's p_drop", "equal noise", "no dropout"


def regimes(claim: Claim, width: float, measure: Callable[[float], Measurement]) -> list[tuple[str, Measurement]]:
    """(regime, measurement) of a claim: at the paper's p_drop and at the equal-noise one for our
    ``width`` (one row where they coincide); once for a claim without dropout or one not testable here."""
    if claim.untestable:
        return [("", Measurement())]
    if claim.p_drop is None:
        return [(NO_DROPOUT, _measured(measure, math.nan))]
    equal = equal_noise_p_drop(claim.p_drop, claim.width, round(width))
    if abs(odds(equal) / odds(claim.p_drop) - 1) <= P_MATCH_TOLERANCE:
        return [(f"{PAPER_P} = {EQUAL_NOISE}", _measured(measure, claim.p_drop))]
    return [(PAPER_P, _measured(measure, claim.p_drop)), (EQUAL_NOISE, _measured(measure, equal))]


def _measured(measure: Callable[[float], Measurement], p: float) -> Measurement:
    """``measure(p)``; a result file it cannot read makes the row not testable (with the error) instead
    of stopping the table."""
    try:
        m = measure(p)
    except (KeyError, ValueError, TypeError, IndexError, OSError) as err:
        m = Measurement(missing=f"could not read the measurement ({type(err).__name__}: {err})")
    return at_p(m, p) if math.isfinite(p) else m


def width_from(p_equal: float, p_reference: float = P_DROP_REFERENCE, reference_width: int = PAPER_WIDTH) -> float:
    """Our target's hidden size d from ``p_equal = equal_noise_p_drop(p_reference, reference_width, d)``."""
    return reference_width * odds(p_equal) / odds(p_reference)


def verdict_table(results_dir: str | Path, p_equal: float, setup: str) -> pd.DataFrame:
    """One row (``COLUMNS``) per claim of the paper and p_drop regime, from the result tables and
    per-example records in ``results_dir``. ``p_equal`` is our target's
    ``analysis.equal_noise_p_drop(0.3, 8192, d)`` (notebook 07's), ``setup`` our setup line."""
    results_dir = Path(results_dir)
    width = width_from(p_equal)
    rows = [_row(claim, m, regime, width, setup) for claim, measure in claims.all_claims(results_dir)
            for regime, m in regimes(claim, width, measure)]
    table = pd.DataFrame(rows, columns=COLUMNS)
    order = {r: i for i, r in enumerate(RESULT_ORDER)}
    return table.sort_values("result", key=lambda s: s.map(order), kind="stable").reset_index(drop=True)


def _row(claim: Claim, m: Measurement, regime: str, width: float, setup: str) -> dict:
    outcome, reason = verdict(claim, m, width)
    e, a = m.estimate, m.agreement or Estimate(math.nan)
    band = (math.nan, math.nan) if claim.untestable else claim.band()
    return {"result": claim.result, "comparison": claim.comparison, "regime": regime,
            "p_drop": math.nan if m.p_drop is None else m.p_drop, "unit": claim.unit, "paper": claim.paper_text(),
            "paper_lo": claim.lo, "paper_hi": claim.hi, "band_lo": band[0], "band_hi": band[1], "ours": e.value,
            "ours_lo": e.lo, "ours_hi": e.hi, "n": e.n, "verdict": outcome, "reason": reason, "agreement": a.value,
            "agreement_lo": a.lo, "agreement_hi": a.hi, "source": e.source, "paper setup": claim.setup,
            "our setup": setup}


def counts(table: pd.DataFrame) -> pd.DataFrame:
    """Rows per result and verdict, the results in the paper's order."""
    out = pd.crosstab(table["result"], table["verdict"]).reindex(columns=list(VERDICTS), fill_value=0)
    return out.reindex([r for r in RESULT_ORDER if r in out.index])


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """What a reader needs: the regime with our p_drop, the paper's value, ours as "value [lo, hi]"."""
    def interval(prefix):
        return [ci_text(Estimate(v, lo, hi)) if math.isfinite(v) else "" for v, lo, hi in
                zip(table[prefix], table[f"{prefix}_lo"], table[f"{prefix}_hi"], strict=True)]

    p_drop = [f"{regime}: {p:.3g}" if math.isfinite(p) else regime for regime, p in
              zip(table["regime"], table["p_drop"], strict=True)]
    return pd.DataFrame({"result": table["result"], "comparison": table["comparison"], "p_drop": p_drop,
                         "unit": table["unit"], "paper": table["paper"], "ours [95 % CI]": interval("ours"),
                         "agreement with lossless [95 % CI]": interval("agreement"), "verdict": table["verdict"],
                         "reason": table["reason"]})


def to_markdown(table: pd.DataFrame) -> str:
    """Counts per result, every comparison, the rules and thresholds, the setups."""
    setups = [f"- {r}: {s}" for r, s in table[["result", "paper setup"]].drop_duplicates().itertuples(index=False) if s]
    parts = ["# Verdicts: the paper's results against ours", "",
             "Computed by `dropmatch.verdicts.verdict_table` from the result tables of the notebook series "
             "(notebooks/07_figures_and_table.ipynb).", "",
             "## Count per result", "", counts(table).to_markdown(), "",
             "## Every comparison", "", display_table(table).to_markdown(index=False), "",
             "## How a verdict is reached", "", rules_text(), "", "Thresholds:", "", thresholds_text(), "",
             "## Setups", "", "Ours: " + "; ".join(sorted(set(table["our setup"]))), "", "The paper's:", "", *setups]
    return "\n".join(parts) + "\n"


def write_verdicts(table: pd.DataFrame, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``verdicts.csv`` (every column) and ``verdicts.md`` (:func:`to_markdown`) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv, md = out_dir / "verdicts.csv", out_dir / "verdicts.md"
    table.to_csv(csv, index=False)
    md.write_text(to_markdown(table))
    return csv, md
