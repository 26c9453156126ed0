"""KLUE-NLI accuracy from the first label word (함의/중립/모순 or entailment/neutral/contradiction),
as an `evaluate` metric over dropmatch.tasks.metrics. references: gold labels in English.
Returns {"accuracy"}.
"""

import datasets
import evaluate

from dropmatch.tasks import metrics


class KlueNliAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="Park et al., 2021, arXiv:2105.09680", inputs_description=__doc__,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        scores = [{"accuracy": metrics.nli_accuracy(metrics.cut_output("klue_nli", p), r)}
                  for p, r in zip(predictions, references, strict=True)]
        return metrics.aggregate(scores)
