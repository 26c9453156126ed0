"""Task metrics, computed offline. ``score(example, output)`` dispatches on ``example.task``.

* GSM8K ``exact_match``: the final number of the output ("#### N" if present, else the last number
  in the text) equals the reference, compared as numbers after dropping ",", "$" and a trailing ".".
* MMLU ``accuracy``: the generated letter, i.e. the first standalone capital A-D in the output, equals
  the reference letter. (Scoring by log-likelihood of the four options needs the model and is not
  done here.)
* HumanEval ``pass@1``: prompt + completion + test + ``check(entry_point)`` runs in the sandbox
  (sandbox.py) and exits cleanly. ``pass_at_k`` is the unbiased estimator of Chen et al. (2021).
* IFEval: prompt-/instruction-level accuracy, strict and loose (ifeval.py).
* KLUE-NLI ``accuracy``: the first label word in the output (함의/중립/모순, or the English names)
  equals the gold label.
* MT-bench, KoMT-bench, KULLM: no offline task metric (they need a judge); ``score`` gives only
  ``output_chars``. Fidelity to the target model is measured elsewhere.

``score`` first cuts the output at the task's stop strings (prompts.GENERATION_DEFAULTS), so raw
and already-cut generations score the same. ``aggregate`` averages per-example scores, pooling
IFEval's instruction-level fields over instructions.

``answer_agreement`` / ``answers_agree`` say whether two runs give the same answer (same final number,
letter or label; same pass or fail for HumanEval and IFEval strict per prompt): a quality measure that
still moves where a small model's task score sits near 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from decimal import Decimal, InvalidOperation

from ..errors import SandboxError
from . import ifeval
from .data import Example
from .prompts import NLI_LABELS, generation_defaults, truncate_at_stop
from .sandbox import Limits, SandboxResult, run_python

# --- GSM8K ---------------------------------------------------------------------------------

# a minus right before the number (or its "$"), not after a word or digit ("9-5" is 5) nor apart ("- 18" is 18)
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\$\s?)?\d[\d,]*(?:\.\d+)?|(?:(?<![\w.])-)?(?:\$\s?)?\.\d+")
_FINAL = re.compile(r"####\s*(" + _NUMBER.pattern + ")")


def normalize_number(text: str) -> str | None:
    """Canonical decimal string: "$1,234.50" -> "1234.5", "18." -> "18"; None if not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    return format(value.normalize(), "f") if value != 0 else "0"


def extract_gsm8k_answer(output: str) -> str | None:
    """The final number: after the first "####" if there is one, else the last number in the text."""
    final = _FINAL.search(output)
    if final:
        return normalize_number(final.group(1))
    numbers = _NUMBER.findall(output)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_exact_match(output: str, reference: str) -> float:
    predicted = extract_gsm8k_answer(output)
    return float(predicted is not None and predicted == normalize_number(reference))


# --- MMLU ----------------------------------------------------------------------------------

_LETTER = re.compile(r"\b([ABCD])\b")


def extract_choice_letter(output: str) -> str | None:
    """The first standalone capital letter A-D ("B", " B.", "(C)", "Answer: D"), or None."""
    found = _LETTER.search(output.strip())
    return found.group(1) if found else None


def mmlu_accuracy(output: str, reference: str) -> float:
    return float(extract_choice_letter(output) == reference)


# --- HumanEval -----------------------------------------------------------------------------

def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"


def humaneval_run(prompt: str, completion: str, test: str, entry_point: str,
                  limits: Limits | None = None) -> SandboxResult:
    return run_python(humaneval_program(prompt, completion, test, entry_point), limits)


def humaneval_pass(prompt: str, completion: str, test: str, entry_point: str,
                   limits: Limits | None = None) -> float:
    """1.0 if the completion passes the tests in the sandbox, else 0.0. ``SandboxError`` where the
    sandbox refused to start the program (no isolation here, or it could not be launched): a score of 0
    there would be silently wrong. A failed setup inside the sandbox counts as not passed: the program
    can fake that exit status."""
    result = humaneval_run(prompt, completion, test, entry_point, limits)
    if result.status == "error" and result.returncode is None:
        raise SandboxError(f"HumanEval cannot be scored here: {result.stderr}")
    return float(result.passed)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --- IFEval --------------------------------------------------------------------------------

def ifeval_score(prompt: str, response: str, instruction_id_list: Sequence[str],
                 kwargs: Sequence[dict]) -> dict[str, float]:
    """One prompt's scores; ``num_instructions`` lets ``aggregate`` pool the instruction level."""
    result = ifeval.check(prompt, response, instruction_id_list, kwargs)
    return {**ifeval.scores([result]), "num_instructions": float(len(result.strict))}


# --- KLUE-NLI ------------------------------------------------------------------------------

_NLI_WORDS = {**{ko: en for en, ko in NLI_LABELS.items()}, **{en: en for en in NLI_LABELS}}
_NLI_PATTERN = re.compile("|".join(map(re.escape, _NLI_WORDS)), re.IGNORECASE)


def extract_nli_label(output: str) -> str | None:
    """entailment / neutral / contradiction, from the first label word (Korean or English)."""
    found = _NLI_PATTERN.search(output)
    return _NLI_WORDS[found.group(0).lower()] if found else None


def nli_accuracy(output: str, reference: str) -> float:
    return float(extract_nli_label(output) == reference)


# --- dispatch ------------------------------------------------------------------------------

def cut_output(task: str, output_text: str) -> str:
    """The generation up to the task's first stop string."""
    return truncate_at_stop(output_text, generation_defaults(task).stop)


def score(example: Example, output_text: str, *, limits: Limits | None = None) -> dict[str, float]:
    """Task metrics of one generation (``limits``: sandbox limits for HumanEval)."""
    task = example.task
    output = cut_output(task, output_text)
    if task == "gsm8k":
        return {"exact_match": gsm8k_exact_match(output, example.reference)}
    if task == "mmlu":
        return {"accuracy": mmlu_accuracy(output, example.reference)}
    if task == "humaneval":
        passed = humaneval_pass(example.prompt, output, example.reference, example.metadata["entry_point"], limits)
        return {"pass@1": passed}
    if task == "ifeval":
        ref = example.reference
        return ifeval_score(example.prompt, output, ref["instruction_id_list"], ref["kwargs"])
    if task == "klue_nli":
        return {"accuracy": nli_accuracy(output, example.reference)}
    return {"output_chars": float(len(output))}


def aggregate(scores: Iterable[dict[str, float]]) -> dict[str, float]:
    """Mean of each field; IFEval's ``inst_level_*`` weighted by ``num_instructions``."""
    scores = list(scores)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in scores for k in s):
        rows = [s for s in scores if key in s]
        if key.startswith("inst_level_"):
            total = sum(s["num_instructions"] for s in rows)
            out[key] = sum(s[key] * s["num_instructions"] for s in rows) / total if total else 0.0
        elif key == "num_instructions":
            out[key] = float(sum(s[key] for s in rows))
        else:
            out[key] = sum(s[key] for s in rows) / len(rows)
    return out


# --- answer agreement with another run (quality where task scores sit at the floor) ---------

PASS_FAIL_SCORE = {"humaneval": "pass@1", "ifeval": "prompt_level_strict_acc"}
"""Tasks whose answers agree when they pass or fail alike (the score key of that pass / fail)."""


def final_answer(task: str, output: str) -> str | None:
    """The answer two runs must share: GSM8K's final number, MMLU's letter, KLUE-NLI's label, else the
    whole (cut) output."""
    output = cut_output(task, output)
    if task == "gsm8k":
        return extract_gsm8k_answer(output)
    if task == "mmlu":
        return extract_choice_letter(output)
    if task == "klue_nli":
        return extract_nli_label(output)
    return output


def answer_agreement(task: str, output_a: str, output_b: str, score_a: dict | None = None,
                     score_b: dict | None = None) -> bool:
    """Whether two generations give the same answer: the same final number (GSM8K), letter (MMLU) or
    label (KLUE-NLI), missing ones included (no number in either agrees); the same pass or fail
    (HumanEval, IFEval strict per prompt: from ``score_a`` / ``score_b``, the outputs' scores); else
    the same cut text."""
    if task in PASS_FAIL_SCORE:
        key = PASS_FAIL_SCORE[task]
        if score_a is None or score_b is None or key not in score_a or key not in score_b:
            raise ValueError(f"{task}: answer agreement compares pass / fail, so it needs both scores' {key}")
        return bool(score_a[key]) == bool(score_b[key])
    return final_answer(task, output_a) == final_answer(task, output_b)


def answers_agree(task: str, record_a: dict, record_b: dict) -> bool:
    """:func:`answer_agreement` of two result records (``output`` and ``score``; multi-turn outputs,
    a list of turns, agree when every turn's text is the same)."""
    a, b = record_a["output"], record_b["output"]
    if isinstance(a, list) or isinstance(b, list):
        return a == b
    return answer_agreement(task, a, b, record_a.get("score"), record_b.get("score"))
