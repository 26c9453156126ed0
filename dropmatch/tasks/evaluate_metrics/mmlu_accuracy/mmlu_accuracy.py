"""MMLU accuracy from the generated letter (first standalone A-D), as an `evaluate` metric over
dropmatch.tasks.metrics. predictions: generations; references: gold letters. Returns {"accuracy"}.
"""

import datasets
import evaluate

from dropmatch.tasks import metrics


class MmluAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="Hendrycks et al., 2021, arXiv:2009.03300", inputs_description=__doc__,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        scores = [{"accuracy": metrics.mmlu_accuracy(metrics.cut_output("mmlu", p), r)}
                  for p, r in zip(predictions, references, strict=True)]
        return metrics.aggregate(scores)
