"""Answer agreement between two runs: the same final number, letter or label; the same pass or fail."""

from __future__ import annotations

import pytest

from dropmatch.tasks.metrics import answer_agreement, answers_agree, final_answer


@pytest.mark.parametrize("a, b, same", [
    ("3 + 15 = 18 eggs.\n#### 18", "She has eighteen, so #### 18.00", True),  # different text, same number
    ("#### 1,234", "The answer is 1234", True),
    ("#### 18", "#### 17", False),
    ("no number here", "nor here", True),  # neither answers: the same (missing) answer
    ("no number here", "#### 4", False),
    ("#### 72\n\nQuestion: 5 apples", "#### 72", True),  # cut at the task's stop string
])
def test_gsm8k_compares_the_final_number(a, b, same):
    assert answer_agreement("gsm8k", a, b) is same


@pytest.mark.parametrize("a, b, same", [(" B", "B. because", True), ("(C)", "Answer: C", True), ("A", "D", False),
                                        ("", "B", False)])
def test_mmlu_compares_the_letter(a, b, same):
    assert answer_agreement("mmlu", a, b) is same


@pytest.mark.parametrize("task, key", [("humaneval", "pass@1"), ("ifeval", "prompt_level_strict_acc")])
def test_pass_fail_tasks_compare_the_scores_not_the_text(task, key):
    passed, failed = {key: 1.0}, {key: 0.0}
    assert answer_agreement(task, "x = 1", "totally different code", passed, {key: 1.0})
    assert answer_agreement(task, "same text", "same text", failed, {key: 0.0})
    assert not answer_agreement(task, "same text", "same text", passed, failed)
    with pytest.raises(ValueError, match="needs both scores"):
        answer_agreement(task, "a", "b")


def test_other_tasks_compare_the_cut_text_and_records_agree_by_output_and_score():
    assert final_answer("klue_nli", "이 문장은 함의 관계") == "entailment"
    assert answer_agreement("klue_nli", "함의", "entailment.") and not answer_agreement("klue_nli", "함의", "모순")
    assert answer_agreement("kullm", "같은 답", "같은 답") and not answer_agreement("kullm", "a", "b")
    a = {"output": "#### 5", "score": {"exact_match": 0.0}}
    assert answers_agree("gsm8k", a, {"output": "so 5", "score": {"exact_match": 0.0}})
    assert answers_agree("mt_bench", {"output": ["t1", "t2"]}, {"output": ["t1", "t2"]})
    assert not answers_agree("mt_bench", {"output": ["t1", "t2"]}, {"output": ["t1", "other"]})
    h = {"output": "code", "score": {"pass@1": 1.0}}
    assert not answers_agree("humaneval", h, {"output": "code", "score": {"pass@1": 0.0}})
