"""Local Hugging Face ``evaluate`` metric modules, one directory each, loadable offline.

``load_metric("gsm8k")`` (a task name or a module name) is ``evaluate.load(<this dir>/<name>)``;
``reference_for(example)`` gives the reference in the form that module's ``compute`` expects::

    metric = load_metric("gsm8k")
    metric.compute(predictions=outputs, references=[reference_for(e) for e in examples])
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import ConfigError

METRICS_DIR = Path(__file__).resolve().parent
MODULES = {
    "gsm8k": "gsm8k_exact_match",
    "mmlu": "mmlu_accuracy",
    "humaneval": "humaneval_pass_at_1",
    "ifeval": "ifeval_accuracy",
    "klue_nli": "klue_nli_accuracy",
}


def load_metric(name: str, **kwargs: Any):
    """The ``evaluate.EvaluationModule`` of a task (or module) name; nothing is fetched."""
    import evaluate

    module = MODULES.get(name, name)
    if module not in MODULES.values():
        raise ConfigError(f"no evaluate metric for {name!r}; known: {', '.join(MODULES)}")
    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(METRICS_DIR / module), **kwargs)


def reference_for(example) -> Any:
    """``example.reference`` in the form the task's evaluate module takes."""
    if example.task == "humaneval":
        return {"prompt": example.prompt, "test": example.reference, "entry_point": example.metadata["entry_point"]}
    if example.task == "ifeval":
        ref = example.reference
        return {"prompt": example.prompt, "instruction_id_list": list(ref["instruction_id_list"]),
                "kwargs": json.dumps(ref["kwargs"])}
    if example.task not in MODULES:
        raise ConfigError(f"task {example.task!r} has no offline task metric")
    return example.reference
