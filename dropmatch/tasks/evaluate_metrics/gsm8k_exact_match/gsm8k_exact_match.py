"""GSM8K exact match of the final number, as an `evaluate` metric over dropmatch.tasks.metrics.

predictions: generated solutions (cut at "\\n\\nQuestion:"); references: the gold final answers
("18", "1,234"). Returns {"exact_match": fraction}.
"""

import datasets
import evaluate

from dropmatch.tasks import metrics


class Gsm8kExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="Cobbe et al., 2021, arXiv:2110.14168", inputs_description=__doc__,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        scores = [{"exact_match": metrics.gsm8k_exact_match(metrics.cut_output("gsm8k", p), r)}
                  for p, r in zip(predictions, references, strict=True)]
        return metrics.aggregate(scores)
