"""HumanEval pass@1 (one completion per task), as an `evaluate` metric over dropmatch.tasks.metrics.

predictions: completions (cut at the HumanEval stop strings); references: {"prompt", "test",
"entry_point"} of each task. Each program runs in dropmatch's sandbox (``timeout_s`` per task).
Returns {"pass@1": fraction}.
"""

import datasets
import evaluate

from dropmatch.tasks import metrics
from dropmatch.tasks.sandbox import Limits


class HumanevalPassAt1(evaluate.Metric):
    def _info(self):
        text = datasets.Value("string")
        return evaluate.MetricInfo(
            description=__doc__, citation="Chen et al., 2021, arXiv:2107.03374", inputs_description=__doc__,
            features=datasets.Features({"predictions": text,
                                        "references": {"prompt": text, "test": text, "entry_point": text}}),
        )

    def _compute(self, predictions, references, timeout_s=10.0):
        limits = Limits(timeout_s=timeout_s)
        scores = [{"pass@1": metrics.humaneval_pass(r["prompt"], metrics.cut_output("humaneval", p), r["test"],
                                                    r["entry_point"], limits)}
                  for p, r in zip(predictions, references, strict=True)]
        return metrics.aggregate(scores)
