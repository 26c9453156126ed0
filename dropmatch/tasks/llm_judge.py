"""Optional MT-bench / KoMT-bench judging by an LLM behind an OpenAI-compatible endpoint.

Configuration: ``DROPMATCH_JUDGE_URL`` (e.g. ``https://api.openai.com/v1`` or a local vLLM server),
``DROPMATCH_JUDGE_MODEL`` (e.g. ``gpt-4``) and, if needed, ``DROPMATCH_JUDGE_API_KEY``; or the
``--judge-url`` / ``--judge-model`` options of ``python -m dropmatch run``. Prompts are FastChat's
single-answer grading prompts shipped with the benchmark (``judge_prompts*.jsonl``): the reference
variant for math, reasoning and coding questions, the multi-turn variant for turn 2. As in FastChat's
``gen_judgment.py``, the references are GPT-4's answers to both turns (``reference_answer*/gpt-4.jsonl``),
not the questions' short ``reference`` field ("5pi"); only where the data directory has no such file
(e.g. questions from the hub) does the short field stand in, with a warning, and the scores are then
not comparable with published ones. Nothing here runs unless an endpoint is configured; offline the
project reports reference-free measures instead.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DataError, JudgeError
from ..paths import data_dir
from .data import Example

NEEDS_REFERENCE = ("math", "reasoning", "coding")
PROMPT_FILES = {"mt_bench": "mt_bench/judge_prompts.jsonl", "komt_bench": "komt_bench/judge_prompts_ko.jsonl"}
REFERENCE_FILES = {"mt_bench": "mt_bench/reference_answer/gpt-4.jsonl",
                   "komt_bench": "komt_bench/reference_answer_ko/gpt-4.jsonl"}
_RATING = re.compile(r"\[\[(\d+(?:\.\d+)?)\]\]")
_RATING_LOOSE = re.compile(r"\[(\d+(?:\.\d+)?)\]")


@dataclass(frozen=True)
class JudgeEndpoint:
    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0

    @classmethod
    def from_env(cls, url: str | None = None, model: str | None = None) -> JudgeEndpoint | None:
        url = url or os.environ.get("DROPMATCH_JUDGE_URL")
        if not url:
            return None
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"judge URL {url!r} is not an http(s) URL; pass the API base, e.g. http://localhost:8000/v1")
        model = model or os.environ.get("DROPMATCH_JUDGE_MODEL")
        if not model:
            raise ConfigError("a judge URL needs a model name: set DROPMATCH_JUDGE_MODEL or pass --judge-model")
        return cls(url.rstrip("/"), model, os.environ.get("DROPMATCH_JUDGE_API_KEY"))

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _open(self, request: urllib.request.Request, timeout_s: float, any_answer: bool = False) -> bytes:
        """The response body, or a :class:`JudgeError` saying what went wrong (no urllib traceback);
        ``any_answer``: an HTTP error other than 401 / 403 counts as an answer (empty body)."""
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (configured URL)
                return response.read()
        except urllib.error.HTTPError as err:
            if any_answer and err.code not in (401, 403):
                return b""
            hint = ": set DROPMATCH_JUDGE_API_KEY" if err.code in (401, 403) else ""
            raise JudgeError(f"the judge endpoint {self.url} refused {request.full_url} (HTTP {err.code} "
                             f"{err.reason}){hint}") from None
        except (OSError, http.client.HTTPException) as err:  # URLError (refused, DNS), timeouts, not HTTP
            reason = getattr(err, "reason", err)
            raise JudgeError(f"the judge endpoint {self.url} is not reachable ({reason}); check --judge-url or "
                             "DROPMATCH_JUDGE_URL") from None

    def check(self) -> None:
        """Fail before any decoding if the endpoint is unreachable or refuses the key: one ``GET /models``
        (a short timeout). A server that answers with another HTTP error (some serve no model list) passes."""
        request = urllib.request.Request(f"{self.url}/models", headers=self._headers())
        self._open(request, min(self.timeout_s, 10.0), any_answer=True)

    def complete(self, system: str, user: str) -> str:
        """The judge's reply to one chat-completions request (temperature 0)."""
        body = json.dumps({"model": self.model, "temperature": 0, "max_tokens": 2048,
                           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
        request = urllib.request.Request(f"{self.url}/chat/completions", data=body.encode(), headers=self._headers())
        reply = self._open(request, self.timeout_s)
        try:
            content = json.loads(reply)["choices"][0]["message"]["content"]
            if not isinstance(content, str):  # null: a refusal, or a reasoning model's reply elsewhere
                raise TypeError(content)
            return content
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"the judge endpoint {self.url} did not answer as an OpenAI-compatible chat-completions "
                             f"server does (no choices[0].message.content in {reply[:200]!r})") from None


def parse_rating(text: str) -> float | None:
    """The judge's "[[r]]" rating (FastChat falls back to "[r]"); None if there is none."""
    found = _RATING.search(text) or _RATING_LOOSE.search(text)
    return float(found.group(1)) if found else None


def load_judge_prompts(task: str, root: str | Path | None = None) -> dict[str, dict]:
    if task not in PROMPT_FILES:
        raise ConfigError(f"no judge prompts for task {task!r}; judging is for {', '.join(PROMPT_FILES)}")
    path = Path(root or data_dir()) / PROMPT_FILES[task]
    if not path.is_file():
        raise DataError(f"no judge prompts at {path}: the benchmark data directory lacks {PROMPT_FILES[task]}")
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        prompts = {r["name"]: r for r in rows if r.get("type") == "single"}
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # UnicodeDecodeError is a ValueError
        raise DataError(f"{path} does not hold judge prompts as FastChat's judge_prompts.jsonl does ({err!r})") from None
    return prompts


def load_reference_answers(task: str, root: str | Path | None = None) -> dict[int, list[str]]:
    """GPT-4's answers to both turns by question id, the references FastChat's judge grades math, reasoning
    and coding answers against; empty, with a warning, where the data directory has no such file."""
    if task not in REFERENCE_FILES:
        raise ConfigError(f"no reference answers for task {task!r}; judging is for {', '.join(REFERENCE_FILES)}")
    path = Path(root or data_dir()) / REFERENCE_FILES[task]
    if not path.is_file():
        warnings.warn(f"no reference answers at {path}: math, reasoning and coding answers are judged against the "
                      "questions' short reference field, so the judge scores are not comparable with published "
                      "ones", stacklevel=2)
        return {}
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        answers = {int(r["question_id"]): [str(t) for t in r["choices"][0]["turns"]] for r in rows}
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise DataError(f"{path} does not hold reference answers as FastChat's reference_answer/gpt-4.jsonl "
                        f"does ({err!r})") from None
    return answers


def judge_example(endpoint: JudgeEndpoint, prompts: dict[str, dict], example: Example, answers: list[str],
                  reference_answers: dict[int, list[str]] | None = None) -> dict[str, float]:
    """Ratings (1-10) of both turns and their mean, as score fields. Math, reasoning and coding answers
    are graded against ``reference_answers`` (:func:`load_reference_answers`) where it holds the question,
    else against the question's own short ``reference``."""
    reference = None
    if example.metadata.get("category") in NEEDS_REFERENCE:
        reference = (reference_answers or {}).get(example.metadata.get("question_id")) or example.reference
    q1, q2 = example.turns
    fields = {"question": q1, "answer": answers[0], "question_1": q1, "question_2": q2,
              "answer_1": answers[0], "answer_2": answers[1] if len(answers) > 1 else ""}
    if reference:
        fields.update(ref_answer_1=reference[0], ref_answer_2=reference[1] if len(reference) > 1 else "")
    scores: dict[str, float] = {}
    for turn, name in ((1, "single-v1"), (2, "single-v1-multi-turn")):
        if reference:
            name = name.replace("single-v1", "single-math-v1")
        prompt = prompts[name]
        rating = parse_rating(endpoint.complete(prompt["system_prompt"], prompt["prompt_template"].format(**fields)))
        if rating is not None:
            scores[f"judge_turn_{turn}"] = rating
    if scores:
        scores["judge_score"] = sum(scores.values()) / len(scores)
    return scores
