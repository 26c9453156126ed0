"""Loaders and prompt formats: counts on the real files, clear errors on missing or wrong files."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from dropmatch import hub
from dropmatch.errors import ConfigError, DataError
from dropmatch.paths import data_dir
from dropmatch.tasks import TASKS, chat_prompt, generation_defaults, load_task, prompts, truncate_at_stop
from dropmatch.tasks import data as data_mod

REAL = data_dir()
HAVE_DATA = (REAL / "gsm8k" / "test.jsonl").exists()
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"benchmark data not found in {REAL} (set DROPMATCH_DATA)")
COUNTS = {"gsm8k": 1319, "mmlu": 14042, "humaneval": 164, "ifeval": 541, "mt_bench": 80, "komt_bench": 80,
          "klue_nli": 3000, "kullm": 252}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def fake_gsm8k(root: Path, n_test: int = 3, n_train: int = 8) -> None:
    rows = [{"question": f"q{i}?", "answer": f"Work {i}.\n#### {i},000"} for i in range(max(n_test, n_train))]
    write_jsonl(root / "gsm8k" / "test.jsonl", rows[:n_test])
    write_jsonl(root / "gsm8k" / "train.jsonl", rows[:n_train])


# --- the real files ----------------------------------------------------------------------------

@needs_data
@pytest.mark.parametrize("task", TASKS)
def test_counts_and_fields(task):
    examples = load_task(task)
    assert len(examples) == COUNTS[task]
    assert len({e.id for e in examples}) == len(examples)
    first = examples[0]
    assert first.task == task
    if task in ("mt_bench", "komt_bench"):
        assert first.prompt is None and len(first.turns) == 2
    else:
        assert isinstance(first.prompt, str) and first.prompt and first.turns is None


@needs_data
def test_limit_is_a_prefix_and_mmlu_spreads_over_subjects():
    assert load_task("gsm8k", limit=5) == load_task("gsm8k")[:5]
    assert load_task("humaneval", limit=0) == []
    mmlu = load_task("mmlu", limit=57)
    assert len({e.metadata["subject"] for e in mmlu}) == 57
    assert [e.id for e in mmlu[:2]] == ["mmlu/abstract_algebra/0", "mmlu/anatomy/0"]
    assert load_task("mmlu", limit=60) == load_task("mmlu", limit=70)[:60]


@needs_data
def test_gsm8k_prompt_is_8_shot_from_train():
    ex = load_task("gsm8k", limit=1)[0]
    assert ex.prompt.count("Question: ") == 9 and ex.prompt.count("#### ") == 8
    assert ex.prompt.startswith("Question: Natalia sold clips")
    assert ex.prompt.endswith(f"Question: {ex.metadata['question']}\nAnswer:")
    assert ex.reference == "18"


@needs_data
def test_mmlu_prompt_is_5_shot_from_dev():
    ex = load_task("mmlu", limit=1)[0]
    assert ex.prompt.startswith("The following are multiple choice questions (with answers) about abstract algebra.\n\n")
    assert ex.prompt.count("\nAnswer:") == 6 and ex.prompt.endswith("\nD. 6\nAnswer:")
    assert ex.reference == "B" and ex.metadata["choices"] == ["0", "4", "2", "6"]


@needs_data
def test_raw_prompts_and_references():
    he = load_task("humaneval", limit=1)[0]
    assert he.id == "HumanEval/0" and he.prompt.startswith("from typing import List")
    assert "def check(candidate)" in he.reference and he.metadata["entry_point"] == "has_close_elements"
    ife = load_task("ifeval", limit=1)[0]
    assert ife.reference["kwargs"] == [{}, {"num_highlights": 3}, {"relation": "at least", "num_words": 300}]
    nli = load_task("klue_nli", limit=1)[0]
    assert nli.reference == "contradiction" and nli.prompt.endswith("관계:")
    kullm = load_task("kullm", limit=1)[0]
    assert "### 입력:" in kullm.prompt and kullm.prompt.endswith("### 응답:\n")


# --- errors ----------------------------------------------------------------------------------

def test_unknown_task_and_bad_limit(tmp_path):
    with pytest.raises(ConfigError, match="unknown task"):
        load_task("squad", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="limit"):
        load_task("gsm8k", data_dir=tmp_path, limit=-1)


def test_missing_file_offline_fails_fast(tmp_path, offline):
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        load_task("humaneval", data_dir=tmp_path)
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert str(tmp_path / "humaneval" / "HumanEval.jsonl.gz") in message
    assert "164" in message and "HF_HUB_OFFLINE" in message and "openai/openai_humaneval" in message


def test_missing_file_without_hub_copy(tmp_path, offline):
    with pytest.raises(DataError, match="no hub copy"):
        load_task("kullm", data_dir=tmp_path)


def test_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # loopback, nothing listens
    hub._probe.cache_clear()
    try:
        start = time.monotonic()
        with pytest.raises(DataError, match="not reachable|no answer"):
            load_task("ifeval", data_dir=tmp_path)
        assert time.monotonic() - start < 6
    finally:
        hub._probe.cache_clear()


def test_wrong_count_names_file_and_expectation(tmp_path, offline):
    fake_gsm8k(tmp_path, n_test=3)
    with pytest.raises(DataError) as err:
        load_task("gsm8k", data_dir=tmp_path)
    assert "holds 3 records, expected 1319" in str(err.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in str(err.value)


def test_unreadable_file(tmp_path, offline):
    path = tmp_path / "ifeval" / "input_data.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"key": 1, "prompt": "x"\nnot json at all\n', encoding="utf-8")
    with pytest.raises(DataError, match="could not read"):
        load_task("ifeval", data_dir=tmp_path)


def test_small_fake_files_load(tmp_path, monkeypatch, offline):
    """With the expected counts lowered, small fake files go through the real loader."""
    fake_gsm8k(tmp_path, n_test=3)
    counts = {"gsm8k": 3, "gsm8k_train": 8}
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=counts.get(k, v.count))
                                               for k, v in data_mod.SOURCES.items()})
    examples = load_task("gsm8k", data_dir=tmp_path)
    assert [e.reference for e in examples] == ["0,000", "1,000", "2,000"]
    assert examples[2].prompt.count("Question:") == 9


def test_fake_mmlu_round_robin(tmp_path, monkeypatch, offline):
    header = "question,choice0,choice1,choice2,choice3,answer\n"
    for subject, n in (("zoology", 3), ("algebra", 1)):
        for split, rows in (("test", n), ("dev", 5)):
            path = tmp_path / "mmlu" / split / f"{subject}_{split}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(header + "".join(f'"{subject} {split} {i}?",None,NA,0.30,"a, b",{i % 4}\n'
                                             for i in range(rows)), encoding="utf-8")
    counts = {"mmlu": 4, "mmlu_dev": 10}
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=counts.get(k, v.count))
                                               for k, v in data_mod.SOURCES.items()})
    examples = load_task("mmlu", data_dir=tmp_path)
    assert [e.id for e in examples] == ["mmlu/algebra/0", "mmlu/zoology/0", "mmlu/zoology/1", "mmlu/zoology/2"]
    assert examples[0].metadata["choices"] == ["None", "NA", "0.30", "a, b"]  # cells kept as written
    assert examples[2].reference == "B"
    assert "about zoology.\n\nzoology dev 0?\nA. None\n" in examples[1].prompt


def test_mmlu_subject_without_dev_file(tmp_path, monkeypatch, offline):
    header = "question,choice0,choice1,choice2,choice3,answer\n"
    for split in ("test", "dev"):
        (tmp_path / "mmlu" / split).mkdir(parents=True)
    (tmp_path / "mmlu" / "test" / "algebra_test.csv").write_text(header + "q,a,b,c,d,0\n", encoding="utf-8")
    (tmp_path / "mmlu" / "dev" / "zoology_dev.csv").write_text(header + "q,a,b,c,d,0\n", encoding="utf-8")
    counts = {"mmlu": 1, "mmlu_dev": 1}
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=counts.get(k, v.count))
                                               for k, v in data_mod.SOURCES.items()})
    with pytest.raises(DataError, match="no dev file .* for algebra"):
        load_task("mmlu", data_dir=tmp_path)


# --- prompt helpers --------------------------------------------------------------------------

def test_chat_prompt_plain_text():
    turns = ["Write a poem.", "Now shorter."]
    assert chat_prompt(turns) == "User: Write a poem.\nAssistant:"
    assert chat_prompt(turns, ["Roses are red."]) == (
        "User: Write a poem.\nAssistant: Roses are red.\nUser: Now shorter.\nAssistant:")
    with pytest.raises(ConfigError):
        chat_prompt(turns, ["a", "b"])


def test_chat_prompt_uses_the_tokenizer_template_when_asked():
    class Tok:
        chat_template = "{% for m in messages %}...{% endfor %}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    assert chat_prompt(["hi", "again"], ["hello"], tokenizer=Tok(), use_chat_template=True) == (
        "user:hi|assistant:hello|user:again|assistant:")
    assert chat_prompt(["hi"], tokenizer=Tok()) == "User: hi\nAssistant:"  # not asked: plain text
    Tok.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        chat_prompt(["hi"], tokenizer=Tok(), use_chat_template=True)


def test_generation_defaults_and_truncation():
    for task in TASKS:
        assert generation_defaults(task).max_new_tokens > 0
    with pytest.raises(ConfigError):
        generation_defaults("nope")
    stops = generation_defaults("humaneval").stop
    assert truncate_at_stop("    return x\n\n\ndef other():\n", stops) == "    return x\n\n"
    assert truncate_at_stop("    return 1\n# done", stops) == "    return 1"
    assert truncate_at_stop("no stop here", stops) == "no stop here"
    assert truncate_at_stop("#### 5\n\nQuestion: next", generation_defaults("gsm8k").stop) == "#### 5"


def test_prompt_builders():
    assert prompts.mmlu_question(" Q? ", ["w", "x", "y", "z"]) == "Q?\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    assert prompts.gsm8k_prompt("q", [("a?", "b #### 1")]) == "Question: a?\nAnswer: b #### 1\n\nQuestion: q\nAnswer:"
    assert "### 입력" not in prompts.kullm_prompt("지시", "")
    assert prompts.klue_nli_prompt("p", "h").count("관계:") == 4


def test_hub_fallback_goes_through_the_same_loader(tmp_path, monkeypatch):
    """A missing file with a reachable hub: the hub rows are mapped onto the local schema."""
    import datasets

    mmlu_row = {"question": "2 + 2?", "subject": "algebra", "choices": ["1", "2", "3", "4"], "answer": 3}
    hub = {
        ("cais/mmlu", "all", "test"): [mmlu_row, {**mmlu_row, "subject": "biology", "answer": 0}],
        ("cais/mmlu", "all", "dev"): [mmlu_row] * 5 + [{**mmlu_row, "subject": "biology"}] * 5,
        ("klue/klue", "nli", "validation"): [{"guid": "g0", "source": "wiki", "premise": "p", "hypothesis": "h",
                                              "label": 2}],
    }
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(hub[(path, name, split)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(data_mod, "hub_reachable", lambda: (True, ""))
    counts = {"mmlu": 2, "mmlu_dev": 10, "klue_nli": 1}
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=counts.get(k, v.count))
                                               for k, v in data_mod.SOURCES.items()})
    mmlu = load_task("mmlu", data_dir=tmp_path)
    assert [(e.id, e.reference) for e in mmlu] == [("mmlu/algebra/0", "D"), ("mmlu/biology/0", "A")]
    assert mmlu[0].prompt.count("Answer: D\n\n") == 5
    assert load_task("klue_nli", data_dir=tmp_path)[0].reference == "contradiction"
    assert calls == [("cais/mmlu", "all", "test"), ("cais/mmlu", "all", "dev"), ("klue/klue", "nli", "validation")]


@pytest.mark.parametrize("task,source,path,good,bad,message", [
    ("gsm8k", "gsm8k", "gsm8k/test.jsonl", {"question": "q?", "answer": "w\n#### 1"}, {"question": "q?"}, "lacks answer"),
    ("gsm8k", "gsm8k", "gsm8k/test.jsonl", {"question": "q?", "answer": "w\n#### 1"},
     {"question": "q?", "answer": "18"}, "without its '#### <number>'"),
    ("humaneval", "humaneval", "humaneval/HumanEval.jsonl.gz", None, None, "lacks test"),
    ("ifeval", "ifeval", "ifeval/input_data.jsonl",
     {"key": 1, "prompt": "p", "instruction_id_list": ["a", "b"], "kwargs": [{}, {}]},
     {"key": 2, "prompt": "p", "instruction_id_list": ["a", "b"], "kwargs": [{}]}, "different lengths"),
    ("mt_bench", "mt_bench", "mt_bench/question.jsonl", {"question_id": 1, "category": "c", "turns": ["a", "b"]},
     {"question_id": 2, "category": "c"}, "lacks turns"),
    ("klue_nli", "klue_nli", "korean_text/klue-nli-v1.1_dev.json",
     {"guid": "g", "premise": "p", "hypothesis": "h", "gold_label": "neutral", "source": "s"},
     {"guid": "g2", "premise": "p", "hypothesis": "h", "source": "s"}, "lacks gold_label"),
    ("kullm", "kullm", "korean_text/user_oriented_instructions_eval.jsonl",
     {"id": "k", "instruction": "i", "instances": [{"input": "", "output": "o"}], "motivation_app": "m"},
     {"id": "k2", "instruction": "i", "instances": [], "motivation_app": "m"}, "no instance"),
])
def test_malformed_records_are_a_data_error_naming_the_record(tmp_path, monkeypatch, offline, task, source, path,
                                                               good, bad, message):
    """A record without a field the loader needs, or with a value out of range, is a DataError naming the
    file and the record, not an AttributeError / IndexError, nor a silent None reference."""
    if good is None:  # humaneval: gzip of jsonl
        import gzip

        good = {"task_id": "t/0", "prompt": "def f():\n", "test": "def check(f): pass\n", "entry_point": "f",
                "canonical_solution": "    pass\n"}
        bad = {k: v for k, v in good.items() if k != "test"}
        file = tmp_path / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(gzip.compress((json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode()))
    else:
        write_jsonl(tmp_path / path, [good, bad])
    if task == "gsm8k":
        write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [good] * 8)
    counts = {source: 2, "gsm8k_train": 8}
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=counts.get(k, v.count))
                                               for k, v in data_mod.SOURCES.items()})
    with pytest.raises(DataError, match=message) as err:
        load_task(task, data_dir=tmp_path)
    assert "record 1 of" in str(err.value) and str(tmp_path / path) in str(err.value)


def test_mmlu_answer_out_of_range_is_a_data_error(tmp_path, monkeypatch, offline):
    header = "question,choice0,choice1,choice2,choice3,answer\n"
    for split, answer in (("test", 7), ("dev", 1)):
        path = tmp_path / "mmlu" / split / f"zoology_{split}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + f"q,a,b,c,d,{answer}\n")
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=1 if k.startswith("mmlu") else v.count)
                                               for k, v in data_mod.SOURCES.items()})
    with pytest.raises(DataError, match="answer 7, not a choice index"):
        load_task("mmlu", data_dir=tmp_path)
