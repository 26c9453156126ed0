"""The task layer: benchmark loaders, prompt formats, offline metrics, and a sandbox for generated code.
It knows nothing about decoding: it turns benchmark files into prompts and scores generated text.

    from dropmatch.tasks import load_task, generation_defaults, score, aggregate
    examples = load_task("gsm8k", limit=10)
    stop = generation_defaults("gsm8k").stop
    results = [score(e, generate(e.prompt, stop)) for e in examples]
    aggregate(results)  # {"exact_match": ...}
"""

from .data import TASKS, Example, load_gsm8k_train, load_task
from .metrics import aggregate, cut_output, score
from .prompts import GenerationDefaults, chat_prompt, generation_defaults, truncate_at_stop
from .sandbox import Limits, SandboxResult, run_python

__all__ = [
    "TASKS",
    "Example",
    "GenerationDefaults",
    "Limits",
    "SandboxResult",
    "aggregate",
    "chat_prompt",
    "cut_output",
    "generation_defaults",
    "load_gsm8k_train",
    "load_task",
    "run_python",
    "score",
    "truncate_at_stop",
]
