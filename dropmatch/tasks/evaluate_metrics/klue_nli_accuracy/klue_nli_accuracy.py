"""KLUE-NLI accuracy from the first label word (함의/중립/모순 or entailment/neutral/contradiction),
as an `evaluate` metric over dropmatch.tasks.metrics. references: gold labels in English.
Returns {"accuracy"}.
"""

from dropmatch.tasks import metrics
from dropmatch.tasks.evaluate_metrics.text_metric import text_metric

KlueNliAccuracy = text_metric("klue_nli", "accuracy", metrics.nli_accuracy, "Park et al., 2021, arXiv:2105.09680", __doc__)
