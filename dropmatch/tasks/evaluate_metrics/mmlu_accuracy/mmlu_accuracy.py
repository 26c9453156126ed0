"""MMLU accuracy from the generated letter (first standalone A-D), as an `evaluate` metric over
dropmatch.tasks.metrics. predictions: generations; references: gold letters. Returns {"accuracy"}.
"""

from dropmatch.tasks import metrics
from dropmatch.tasks.evaluate_metrics.text_metric import text_metric

MmluAccuracy = text_metric("mmlu", "accuracy", metrics.mmlu_accuracy, "Hendrycks et al., 2021, arXiv:2009.03300", __doc__)
