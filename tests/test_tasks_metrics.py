"""Task metrics on hand-made right and wrong answers, and the `evaluate` wrappers against them."""

from __future__ import annotations

import pytest

from dropmatch.paths import data_dir
from dropmatch.tasks import Example, aggregate, ifeval, load_task, metrics, score

HAVE_HUMANEVAL = (data_dir() / "humaneval" / "HumanEval.jsonl.gz").exists()

ADD = Example(
    "toy/add", "humaneval", 'def add(a, b):\n    """Sum of a and b."""\n', None,
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    {"entry_point": "add", "canonical_solution": "    return a + b\n"},
)


# --- GSM8K -----------------------------------------------------------------------------------

@pytest.mark.parametrize("output, reference", [
    ("She has 3 + 15 = 18 eggs.\n#### 18", "18"),
    ("#### 1,234", "1234"),
    ("#### $1,234.00", "1,234"),
    ("So the total is $18.", "18"),
    ("The answer is 18.00 dollars", "18"),
    ("It fell by -5 degrees", "-5"),
    ("#### 72\n\nQuestion: another one with 5 apples", "72"),  # the first "####" wins
    ("First 12, then 7, and finally 2125", "2,125"),  # no "####": the last number
    ("#### 0.5", ".5"),
    ("Total eggs left:\n- 18", "18"),  # a list dash, not a minus
    ("She works 9-5 and earns 18", "18"),
    ("She works 9-5", "5"),  # a range's hyphen, not a minus
    ("x = -$3", "-3"),
])
def test_gsm8k_right(output, reference):
    assert metrics.gsm8k_exact_match(output, reference) == 1.0


@pytest.mark.parametrize("output, reference", [
    ("#### 17", "18"),
    ("18 eggs, so 19 in the end", "18"),
    ("I don't know", "18"),
    ("", "18"),
    ("#### 18\n#### 19", "19"),
])
def test_gsm8k_wrong(output, reference):
    assert metrics.gsm8k_exact_match(output, reference) == 0.0


def test_number_normalisation():
    assert metrics.normalize_number("$1,234.50") == "1234.5"
    assert metrics.normalize_number("100") == "100"
    assert metrics.normalize_number("18.") == "18"
    assert metrics.normalize_number("-0.0") == "0"
    assert metrics.normalize_number("abc") is None
    assert metrics.extract_gsm8k_answer("no digits") is None


# --- MMLU and KLUE-NLI -----------------------------------------------------------------------

@pytest.mark.parametrize("output, letter", [
    (" B", "B"), ("B.", "B"), ("(C) because", "C"), ("Answer: D", "D"), ("\n A. 42", "A"),
    ("The answer is C", "C"), ("Because D", "D"), ("none of these", None), ("b", None),
])
def test_mmlu_letter(output, letter):
    assert metrics.extract_choice_letter(output) == letter
    assert metrics.mmlu_accuracy(output, "C") == float(letter == "C")


@pytest.mark.parametrize("output, label", [
    (" 모순", "contradiction"), ("함의\n", "entailment"), (" 중립입니다", "neutral"),
    ("Entailment", "entailment"), ("모르겠다", None),
])
def test_nli_label(output, label):
    assert metrics.extract_nli_label(output) == label


# --- HumanEval -------------------------------------------------------------------------------

def test_humaneval_toy_task():
    assert score(ADD, ADD.metadata["canonical_solution"]) == {"pass@1": 1.0}
    assert score(ADD, "    return a - b\n") == {"pass@1": 0.0}
    assert score(ADD, "    return a +\n") == {"pass@1": 0.0}  # syntax error
    # Text after a stop string is cut before running, as a generation would be.
    assert score(ADD, "    return a + b\n\ndef junk(:\n") == {"pass@1": 1.0}
    run = metrics.humaneval_run(ADD.prompt, "    return a - b\n", ADD.reference, "add")
    assert run.status == "failed" and "AssertionError" in run.stderr


@pytest.mark.skipif(not HAVE_HUMANEVAL, reason="HumanEval data not found (set DROPMATCH_DATA)")
def test_humaneval_canonical_solutions_pass():
    tasks = {e.id: e for e in load_task("humaneval")}
    for task_id in ("HumanEval/0", "HumanEval/2", "HumanEval/162"):
        ex = tasks[task_id]
        assert score(ex, ex.metadata["canonical_solution"]) == {"pass@1": 1.0}, task_id
    assert score(tasks["HumanEval/0"], "    return False\n") == {"pass@1": 0.0}
    assert score(tasks["HumanEval/2"], "    return number\n") == {"pass@1": 0.0}


def test_pass_at_k():
    assert metrics.pass_at_k(10, 0, 1) == 0.0
    assert metrics.pass_at_k(10, 10, 5) == 1.0
    assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert metrics.pass_at_k(5, 1, 2) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        metrics.pass_at_k(3, 4, 1)


# --- IFEval ----------------------------------------------------------------------------------

def ifeval_example(instructions: list[str], kwargs: list[dict], prompt: str = "Write something.") -> Example:
    return Example("ifeval/t", "ifeval", prompt, None, {"instruction_id_list": instructions, "kwargs": kwargs})


IFEVAL_CASES = [
    # (instructions, kwargs, compliant response, non-compliant response)
    (["punctuation:no_comma"], [{}], "No commas appear here at all.", "Well, here is one."),
    (["change_case:english_lowercase"], [{}], "all of this is lower case.", "This is Not lower case."),
    (["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 3}],
     "Mr. Smith went to Washington. He stayed.", "One. Two. Three. Four."),
    (["change_case:capital_word_frequency"], [{"capital_relation": "at least", "capital_frequency": 3}],
     "The KEY points are SOLAR and WIND power.", "Only ONE capital word here."),
    (["detectable_format:json_format"], [{}], '{"name": "diaper", "soft": true}', "name: diaper"),
    (["keywords:existence"], [{"keywords": ["atlantis", "constable"]}],
     "The constable searched for Atlantis.", "The officer searched for the lost city."),
    (["language:response_language"], [{"language": "ko"}],
     "햄버거는 빵 사이에 고기를 넣은 음식이므로 샌드위치의 한 종류라고 볼 수 있습니다.",
     "A hamburger is a kind of sandwich because the meat sits between two pieces of bread."),
    (["length_constraints:number_words"], [{"relation": "at least", "num_words": 5}],
     "one two three four five six", "too short"),
]


@pytest.mark.parametrize("instructions, kwargs, good, bad", IFEVAL_CASES)
def test_ifeval_single_instruction(instructions, kwargs, good, bad):
    ex = ifeval_example(instructions, kwargs)
    assert score(ex, good) == {"prompt_level_strict_acc": 1.0, "inst_level_strict_acc": 1.0,
                               "prompt_level_loose_acc": 1.0, "inst_level_loose_acc": 1.0,
                               "num_instructions": 1.0}
    assert score(ex, bad)["prompt_level_strict_acc"] == 0.0
    assert score(ex, bad)["inst_level_loose_acc"] == 0.0


def test_ifeval_loose_drops_first_line_and_asterisks():
    ex = ifeval_example(["change_case:english_lowercase"], [{}])
    result = score(ex, "Sure! Here It Is:\nall lower case from here on.")
    assert result["prompt_level_strict_acc"] == 0.0 and result["prompt_level_loose_acc"] == 1.0


def test_ifeval_several_instructions_and_pooling():
    ex = ifeval_example(["punctuation:no_comma", "change_case:english_lowercase", "keywords:existence"],
                        [{}, {}, {"keywords": ["moon"]}])
    partial = score(ex, "the moon is bright, and full.")  # lower case and keyword, but a comma
    assert partial["prompt_level_strict_acc"] == 0.0
    assert partial["inst_level_strict_acc"] == pytest.approx(2 / 3)
    one = score(ifeval_example(["punctuation:no_comma"], [{}]), "fine")
    pooled = aggregate([partial, one])
    assert pooled["inst_level_strict_acc"] == pytest.approx(3 / 4)  # pooled over 4 instructions
    assert pooled["prompt_level_strict_acc"] == pytest.approx(1 / 2)
    assert pooled["num_instructions"] == 4.0


def test_ifeval_empty_response_follows_nothing():
    assert score(ifeval_example(["punctuation:no_comma"], [{}]), "   ")["inst_level_loose_acc"] == 0.0


def test_ifeval_runs_offline_with_bundled_punkt(monkeypatch):
    import nltk

    def no_download(*args, **kwargs):
        raise AssertionError("nltk.download must not be called")

    monkeypatch.setattr(nltk, "download", no_download)
    root = ifeval.ensure_punkt()
    assert (root / "tokenizers" / "punkt_tab" / "english" / "abbrev_types.txt").exists()
    assert nltk.data.path[0] == str(root)
    assert nltk.sent_tokenize("Dr. Who met Mr. Smith. They talked.") == ["Dr. Who met Mr. Smith.", "They talked."]


# --- score() and aggregate() -----------------------------------------------------------------

def test_score_dispatch_for_tasks_without_metric():
    chat = Example("mt_bench/81", "mt_bench", None, ["a", "b"], None, {})
    assert score(chat, "hello\nUser: more") == {"output_chars": 5.0}
    assert score(Example("k", "kullm", "p", None, "ref", {}), "응답") == {"output_chars": 2.0}
    nli = Example("n", "klue_nli", "p", None, "neutral", {})
    assert score(nli, " 중립\n전제: ...") == {"accuracy": 1.0}
    assert aggregate([{"accuracy": 1.0}, {"accuracy": 0.0}, {"accuracy": 1.0}]) == {"accuracy": pytest.approx(2 / 3)}
    assert aggregate([]) == {}


# --- the evaluate wrappers equal the plain functions -----------------------------------------

def mc(task: str, reference: str) -> Example:
    return Example(f"{task}/x", task, "prompt", None, reference, {})


WRAPPER_CASES = {
    "gsm8k": ([mc("gsm8k", "18"), mc("gsm8k", "1,234"), mc("gsm8k", "7")],
              ["#### 18", "so $1,234.", "#### 8\n\nQuestion: 7"]),
    "mmlu": ([mc("mmlu", "A"), mc("mmlu", "C"), mc("mmlu", "D")], [" A", "(B)", " D\nnext"]),
    "klue_nli": ([mc("klue_nli", "entailment"), mc("klue_nli", "neutral")], [" 함의", " 모순"]),
    "humaneval": ([ADD, ADD, ADD], ["    return a + b\n", "    return a * b\n", "    while True:\n        pass\n"]),
    "ifeval": ([ifeval_example(*case[:2]) for case in IFEVAL_CASES[:4]]
               + [ifeval_example(["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}])],
               [case[2] for case in IFEVAL_CASES[:2]] + [case[3] for case in IFEVAL_CASES[2:4]] + ["a, b"]),
}


@pytest.mark.parametrize("task", list(WRAPPER_CASES))
def test_evaluate_wrapper_matches_plain_function(task):
    from dropmatch.tasks.evaluate_metrics import load_metric, reference_for

    examples, outputs = WRAPPER_CASES[task]
    kwargs = {"timeout_s": 2.0} if task == "humaneval" else {}
    limits = metrics.Limits(timeout_s=2.0)
    plain = aggregate(score(e, o, limits=limits) for e, o in zip(examples, outputs, strict=True))
    plain.pop("num_instructions", None)
    wrapped = load_metric(task).compute(predictions=outputs, references=[reference_for(e) for e in examples],
                                        **kwargs)
    assert wrapped == pytest.approx(plain)
    assert all(0.0 < v < 1.0 for v in plain.values())  # mixed cases: neither all right nor all wrong
