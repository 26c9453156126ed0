"""One builder for the `evaluate` modules that score generated text against a string reference."""

from __future__ import annotations

from collections.abc import Callable

import datasets
import evaluate

from .. import metrics


def text_metric(task: str, field: str, score: Callable[[str, str], float], citation: str, doc: str) -> type:
    """An ``evaluate.Metric`` class: ``score(cut_output(task, prediction), reference)`` per pair, averaged
    into ``{field: mean}``."""

    class TextMetric(evaluate.Metric):
        def _info(self):
            return evaluate.MetricInfo(
                description=doc, citation=citation, inputs_description=doc,
                features=datasets.Features({"predictions": datasets.Value("string"),
                                            "references": datasets.Value("string")}),
            )

        def _compute(self, predictions, references):
            scores = [{field: score(metrics.cut_output(task, p), r)} for p, r in zip(predictions, references, strict=True)]
            return metrics.aggregate(scores)

    TextMetric.__doc__ = doc
    return TextMetric
