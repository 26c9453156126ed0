"""Prompt formats for base models, in the style of lm-evaluation-harness, and per-task generation
defaults (stop strings, max_new_tokens).

GSM8K, 8-shot (the first 8 train problems, answers verbatim, calculator notes and "#### N" kept)::

    Question: <train q1>\\nAnswer: <train solution 1 ... #### N>\\n\\n ... (8 exemplars)
    Question: <q>\\nAnswer:

MMLU, 5-shot from the subject's dev split (subject with spaces for underscores)::

    The following are multiple choice questions (with answers) about <subject>.\\n\\n
    <dev q>\\nA. <c0>\\nB. <c1>\\nC. <c2>\\nD. <c3>\\nAnswer: <letter>\\n\\n ... (5 exemplars)
    <q>\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:

HumanEval and IFEval: the raw prompt.

MT-bench / KoMT-bench (two turns): plain text for base models, ``"User: <turn 1>\\nAssistant:"`` and,
for turn 2, ``"User: <turn 1>\\nAssistant: <answer 1>\\nUser: <turn 2>\\nAssistant:"``; or the
tokenizer's chat template (``add_generation_prompt=True``) when asked for and the tokenizer has one.

KLUE-NLI: a Korean 3-shot classification prompt; the exemplars are written for this package (none
comes from the dev set, so all 3000 pairs stay evaluable); the answer is one of 함의 (entailment),
중립 (neutral), 모순 (contradiction)::

    전제와 가설을 읽고, 전제가 참일 때 가설이 참이면 함의, 알 수 없으면 중립, 거짓이면 모순이라고 답하세요.\\n\\n
    전제: <p>\\n가설: <h>\\n관계: 함의\\n\\n ... (3 exemplars)
    전제: <p>\\n가설: <h>\\n관계:

KULLM (Korean user-oriented instructions): an Alpaca-style Korean template, the input block left out
when the instance has no input::

    다음은 작업을 설명하는 지시문입니다. 요청을 알맞게 완수하는 응답을 작성하세요.\\n\\n
    ### 지시문:\\n<instruction>\\n\\n### 입력:\\n<input>\\n\\n### 응답:\\n
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

LETTERS = "ABCD"
NLI_LABELS = {"entailment": "함의", "neutral": "중립", "contradiction": "모순"}


@dataclass(frozen=True)
class GenerationDefaults:
    stop: tuple[str, ...]
    max_new_tokens: int


GENERATION_DEFAULTS = {
    "gsm8k": GenerationDefaults(("\n\nQuestion:",), 256),
    "mmlu": GenerationDefaults(("\n",), 4),
    "humaneval": GenerationDefaults(("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"), 384),
    "ifeval": GenerationDefaults((), 512),
    "mt_bench": GenerationDefaults(("\nUser:",), 512),
    "komt_bench": GenerationDefaults(("\nUser:",), 512),
    "klue_nli": GenerationDefaults(("\n",), 4),
    "kullm": GenerationDefaults(("\n### ",), 256),
}


def generation_defaults(task: str) -> GenerationDefaults:
    try:
        return GENERATION_DEFAULTS[task]
    except KeyError:
        raise ConfigError(f"unknown task {task!r}; known: {', '.join(GENERATION_DEFAULTS)}") from None


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the earliest stop string (not included)."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


# --- GSM8K ---------------------------------------------------------------------------------

def gsm8k_prompt(question: str, exemplars: Sequence[tuple[str, str]]) -> str:
    """``exemplars``: (question, worked solution ending in "#### N") pairs."""
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in exemplars)
    return f"{shots}Question: {question}\nAnswer:"


# --- MMLU ----------------------------------------------------------------------------------

def mmlu_question(question: str, choices: Sequence[str]) -> str:
    lines = [question.strip(), *(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_prompt(subject: str, question: str, choices: Sequence[str],
                exemplars: Sequence[tuple[str, Sequence[str], int]]) -> str:
    """``exemplars``: (question, choices, answer index) rows of the subject's dev split."""
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    shots = "".join(f"{mmlu_question(q, c)} {LETTERS[a]}\n\n" for q, c, a in exemplars)
    return head + shots + mmlu_question(question, choices)


# --- chat (MT-bench, KoMT-bench) ------------------------------------------------------------

def chat_prompt(turns: Sequence[str], answers: Sequence[str] = (), *, tokenizer: Any = None,
                use_chat_template: bool = False) -> str:
    """The conversation so far, ending where the assistant answers ``turns[len(answers)]``."""
    if not 0 <= len(answers) < len(turns):
        raise ConfigError(f"{len(answers)} answers for {len(turns)} turns: nothing left to answer")
    user_turns = turns[: len(answers) + 1]
    if use_chat_template:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("use_chat_template=True needs a tokenizer with a chat template")
        messages = []
        for i, turn in enumerate(user_turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = []
    for i, turn in enumerate(user_turns):
        parts.append(f"User: {turn}\nAssistant:")
        if i < len(answers):
            parts.append(f" {answers[i].strip()}\n")
    return "".join(parts)


# --- KLUE-NLI ------------------------------------------------------------------------------

NLI_INSTRUCTION = (
    "전제와 가설을 읽고, 전제가 참일 때 가설이 참이면 함의, 알 수 없으면 중립, 거짓이면 모순이라고 답하세요.\n\n"
)
NLI_EXEMPLARS = (
    ("오늘 아침부터 비가 많이 내려서 우산을 챙겨 나갔다.", "오늘은 비가 왔다.", "entailment"),
    ("그 식당은 역에서 걸어서 오 분 거리에 있다.", "그 식당은 음식이 맛있다.", "neutral"),
    ("도서관은 매주 월요일에 문을 닫는다.", "도서관은 월요일에도 문을 연다.", "contradiction"),
)


def klue_nli_prompt(premise: str, hypothesis: str) -> str:
    shots = "".join(f"전제: {p}\n가설: {h}\n관계: {NLI_LABELS[y]}\n\n" for p, h, y in NLI_EXEMPLARS)
    return f"{NLI_INSTRUCTION}{shots}전제: {premise}\n가설: {hypothesis}\n관계:"


# --- KULLM ---------------------------------------------------------------------------------

KULLM_HEADER = "다음은 작업을 설명하는 지시문입니다. 요청을 알맞게 완수하는 응답을 작성하세요.\n\n"


def kullm_prompt(instruction: str, input_text: str = "") -> str:
    body = f"### 지시문:\n{instruction.strip()}\n\n"
    if input_text.strip():
        body += f"### 입력:\n{input_text.strip()}\n\n"
    return f"{KULLM_HEADER}{body}### 응답:\n"
