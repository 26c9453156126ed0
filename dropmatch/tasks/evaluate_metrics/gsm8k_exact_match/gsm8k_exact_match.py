"""GSM8K exact match of the final number, as an `evaluate` metric over dropmatch.tasks.metrics.

predictions: generated solutions (cut at "\\n\\nQuestion:"); references: the gold final answers
("18", "1,234"). Returns {"exact_match": fraction}.
"""

from dropmatch.tasks import metrics
from dropmatch.tasks.evaluate_metrics.text_metric import text_metric

Gsm8kExactMatch = text_metric("gsm8k", "exact_match", metrics.gsm8k_exact_match, "Cobbe et al., 2021, arXiv:2110.14168", __doc__)
