"""The verdict table of notebook 07: for each numbered result of the paper (Fig. 1, 3, 5, 6; Tables 1-10)
the paper's value, ours with a 95 % interval, and a verdict computed from stated thresholds.

    table = verdict_table(results_dir, p_equal, setup)   # one row per claim and p_drop regime
    write_verdicts(table, results_dir)                   # verdicts.csv and verdicts.md

``rules`` holds the thresholds and the verdict rule, ``measure`` reads our numbers (paired over the
per-example records where they exist), ``claims`` pairs each claim of the paper with its measurement,
``table`` builds and writes the table.
"""

from .rules import (
    DIFFERENT_REGIME,
    NOT_REPRODUCED,
    NOT_TESTABLE,
    REPRODUCED,
    THRESHOLDS,
    VERDICTS,
    Claim,
    Measurement,
    interval_test,
    thresholds_text,
    verdict,
)
from .table import (
    COLUMNS,
    RESULT_ORDER,
    counts,
    display_table,
    regimes,
    to_markdown,
    verdict_table,
    write_verdicts,
)

__all__ = [
    "COLUMNS", "DIFFERENT_REGIME", "NOT_REPRODUCED", "NOT_TESTABLE", "REPRODUCED", "RESULT_ORDER", "THRESHOLDS",
    "VERDICTS", "Claim", "Measurement", "counts", "display_table", "interval_test", "regimes", "thresholds_text",
    "to_markdown", "verdict", "verdict_table", "write_verdicts",
]
