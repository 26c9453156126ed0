"""IFEval prompt- and instruction-level accuracy, strict and loose, as an `evaluate` metric over
dropmatch.tasks.metrics (checkers from lm-eval, run offline).

predictions: responses; references: {"prompt", "instruction_id_list", "kwargs"} where "kwargs" is
the JSON text of the list of per-instruction argument dicts. Returns prompt_level_strict_acc,
inst_level_strict_acc, prompt_level_loose_acc, inst_level_loose_acc.
"""

import json

import datasets
import evaluate

from dropmatch.tasks import metrics


class IfevalAccuracy(evaluate.Metric):
    def _info(self):
        text = datasets.Value("string")
        return evaluate.MetricInfo(
            description=__doc__, citation="Zhou et al., 2023, arXiv:2311.07911", inputs_description=__doc__,
            features=datasets.Features({"predictions": text, "references": {
                "prompt": text, "instruction_id_list": datasets.Sequence(text), "kwargs": text}}),
        )

    def _compute(self, predictions, references):
        scores = [metrics.ifeval_score(r["prompt"], metrics.cut_output("ifeval", p), r["instruction_id_list"],
                                       json.loads(r["kwargs"]))
                  for p, r in zip(predictions, references, strict=True)]
        out = metrics.aggregate(scores)
        out.pop("num_instructions", None)
        return out
