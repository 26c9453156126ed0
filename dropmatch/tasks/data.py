"""Benchmark loaders: ``load_task(name)`` gives a list of ``Example`` in a fixed order.

Files are read from the data directory (``dropmatch.paths.data_dir()``: ``$DROPMATCH_DATA``, else
``../shared/data`` beside the checkout, else ``data/``) with ``datasets.load_dataset("json"/"csv")``;
its Arrow cache goes to ``$DROPMATCH_CACHE/datasets`` (default ``~/.cache/dropmatch/datasets``).
Every full file is checked against its known record count. A missing file falls back to the
Hugging Face hub copy when the hub is reachable; offline (``HF_HUB_OFFLINE=1`` or no connection
within 3 s) it is a ``DataError`` at once. The layout and formats are in data/README.md.

Order: file order, except MMLU, which is round-robin over subjects sorted by name (row 0 of every
subject, then row 1 of every subject, ...), so ``limit=N`` (always "the first N") spans subjects.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError
from ..hub import hub_reachable
from ..paths import cache_root
from ..paths import data_dir as default_data_dir
from . import prompts

TASKS = ("gsm8k", "mmlu", "humaneval", "ifeval", "mt_bench", "komt_bench", "klue_nli", "kullm")
GSM8K_SHOTS = 8
MMLU_SHOTS = 5


@dataclass(frozen=True)
class Example:
    id: str
    task: str
    prompt: str | None  # base-model prompt; None for multi-turn chat tasks (see ``turns``)
    turns: list[str] | None = None
    reference: Any = None  # final answer, letter, test code, IFEval instructions... (see README)
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    path: str  # relative to the data dir; a directory of per-subject CSVs for MMLU
    builder: str  # "json" or "csv"
    count: int  # records in the full file(s)
    what: str
    hub: tuple[str, str | None, str] | None  # (repo, config, split) of the hub copy


SOURCES = {
    "gsm8k": Source("gsm8k/test.jsonl", "json", 1319, "GSM8K test problems", ("openai/gsm8k", "main", "test")),
    "gsm8k_train": Source("gsm8k/train.jsonl", "json", 7473, "GSM8K train problems (few-shot exemplars)",
                          ("openai/gsm8k", "main", "train")),
    "mmlu": Source("mmlu/test", "csv", 14042, "MMLU test questions in 57 <subject>_test.csv files",
                   ("cais/mmlu", "all", "test")),
    "mmlu_dev": Source("mmlu/dev", "csv", 285, "MMLU dev questions in 57 <subject>_dev.csv files (5 each)",
                       ("cais/mmlu", "all", "dev")),
    "humaneval": Source("humaneval/HumanEval.jsonl.gz", "json", 164, "HumanEval tasks",
                        ("openai/openai_humaneval", None, "test")),
    "ifeval": Source("ifeval/input_data.jsonl", "json", 541, "IFEval prompts", ("google/IFEval", None, "train")),
    "mt_bench": Source("mt_bench/question.jsonl", "json", 80, "MT-bench questions",
                       ("HuggingFaceH4/mt_bench_prompts", None, "train")),
    "komt_bench": Source("komt_bench/question_ko.jsonl", "json", 80, "KoMT-bench questions",
                         ("LGAI-EXAONE/KoMT-Bench", None, "train")),
    "klue_nli": Source("korean_text/klue-nli-v1.1_dev.json", "json", 3000, "KLUE-NLI dev pairs",
                       ("klue/klue", "nli", "validation")),
    "kullm": Source("korean_text/user_oriented_instructions_eval.jsonl", "json", 252,
                    "KULLM user-oriented instructions (no hub copy known)", None),
}
NLI_IDS = ("entailment", "neutral", "contradiction")  # klue/klue label order on the hub


def load_task(name: str, data_dir: str | Path | None = None, limit: int | None = None) -> list[Example]:
    """The examples of benchmark ``name`` (one of ``TASKS``); ``limit`` keeps the first N."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    if limit is not None and limit < 0:
        raise ConfigError(f"limit must be >= 0 or None, got {limit}")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    examples = _BUILDERS[name](root)
    return examples if limit is None else examples[:limit]


# --- one builder per task ---------------------------------------------------------------------

def _gsm8k(root: Path) -> list[Example]:
    test = _records("gsm8k", root)
    shots = [(r["question"], r["answer"]) for r in _records("gsm8k_train", root)[:GSM8K_SHOTS]]
    out = []
    for i, r in enumerate(test):
        final = r["answer"].split("####")[-1].strip()
        out.append(Example(f"gsm8k/{i}", "gsm8k", prompts.gsm8k_prompt(r["question"], shots), None, final,
                           {"question": r["question"], "solution": r["answer"]}))
    return out


def load_gsm8k_train(limit: int | None = None, data_dir: str | Path | None = None) -> list[Example]:
    """GSM8K train problems in the test prompt format (for mining a judge), after the 8 exemplars."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    train = _records("gsm8k_train", root)
    shots = [(r["question"], r["answer"]) for r in train[:GSM8K_SHOTS]]
    rows = train[GSM8K_SHOTS:] if limit is None else train[GSM8K_SHOTS : GSM8K_SHOTS + limit]
    return [Example(f"gsm8k_train/{GSM8K_SHOTS + i}", "gsm8k", prompts.gsm8k_prompt(r["question"], shots), None,
                    r["answer"].split("####")[-1].strip(), {"question": r["question"], "solution": r["answer"]})
            for i, r in enumerate(rows)]


def _mmlu(root: Path) -> list[Example]:
    test, dev = _records("mmlu", root), _records("mmlu_dev", root)
    missing = sorted(set(test) - set(dev))
    if missing:
        raise DataError(f"mmlu: no dev file (few-shot exemplars) for {', '.join(missing)} in "
                        f"{root / SOURCES['mmlu_dev'].path}")
    rows = []
    for subject in sorted(test):
        shots = [(d["question"], _choices(d), int(d["answer"])) for d in dev[subject][:MMLU_SHOTS]]
        rows.append([(subject, i, r, shots) for i, r in enumerate(test[subject])])
    out = []
    for group in zip_longest(*rows):  # round-robin over subjects
        for subject, i, r, shots in filter(None, group):
            answer, choices = int(r["answer"]), _choices(r)
            out.append(Example(
                f"mmlu/{subject}/{i}", "mmlu", prompts.mmlu_prompt(subject, r["question"], choices, shots),
                None, prompts.LETTERS[answer],
                {"subject": subject, "question": r["question"], "choices": choices, "answer_index": answer},
            ))
    return out


def _humaneval(root: Path) -> list[Example]:
    return [
        Example(r["task_id"], "humaneval", r["prompt"], None, r["test"],
                {"entry_point": r["entry_point"], "canonical_solution": r["canonical_solution"]})
        for r in _records("humaneval", root)
    ]


def _ifeval(root: Path) -> list[Example]:
    out = []
    for r in _records("ifeval", root):
        # The JSON loader gives every kwargs dict the union of keys; the unset ones come back None.
        kwargs = [{k: v for k, v in (kw or {}).items() if v is not None} for kw in r["kwargs"]]
        reference = {"instruction_id_list": list(r["instruction_id_list"]), "kwargs": kwargs}
        out.append(Example(f"ifeval/{r['key']}", "ifeval", r["prompt"], None, reference, {"key": r["key"]}))
    return out


def _chat(task: str):
    def build(root: Path) -> list[Example]:
        return [
            Example(f"{task}/{r['question_id']}", task, None, list(r["turns"]), r.get("reference"),
                    {"question_id": r["question_id"], "category": r["category"]})
            for r in _records(task, root)
        ]

    return build


def _klue_nli(root: Path) -> list[Example]:
    return [
        Example(r["guid"], "klue_nli", prompts.klue_nli_prompt(r["premise"], r["hypothesis"]), None,
                r["gold_label"], {"premise": r["premise"], "hypothesis": r["hypothesis"], "source": r["source"]})
        for r in _records("klue_nli", root)
    ]


def _kullm(root: Path) -> list[Example]:
    out = []
    for r in _records("kullm", root):
        instance = r["instances"][0]
        out.append(Example(
            r["id"], "kullm", prompts.kullm_prompt(r["instruction"], instance["input"]), None, instance["output"],
            {"instruction": r["instruction"], "input": instance["input"], "motivation_app": r["motivation_app"]},
        ))
    return out


_BUILDERS = {
    "gsm8k": _gsm8k, "mmlu": _mmlu, "humaneval": _humaneval, "ifeval": _ifeval,
    "mt_bench": _chat("mt_bench"), "komt_bench": _chat("komt_bench"), "klue_nli": _klue_nli, "kullm": _kullm,
}


def _choices(row: dict) -> list[str]:
    return [str(row[f"choice{i}"]) for i in range(4)]


# --- reading files (or the hub) -----------------------------------------------------------------

def _records(key: str, root: Path) -> Any:
    """The records of ``SOURCES[key]``: a list of dicts, or {subject: list} for MMLU."""
    src = SOURCES[key]
    path = root / src.path
    data = _read_local(key, src, path) if path.exists() else _read_hub(key, src, path)
    n = sum(map(len, data.values())) if isinstance(data, dict) else len(data)
    if n != src.count:
        raise DataError(f"{key}: {path} holds {n} records, expected {src.count} {src.what}; "
                        "replace it with the file listed in data/README.md")
    for i, record in enumerate(r for rows in (data.values() if isinstance(data, dict) else [data]) for r in rows):
        problem = _record_problem(key, record)
        if problem:
            raise DataError(f"{key}: record {i} of {path} {problem}; expected {src.what} "
                            "(replace the file with the one listed in data/README.md)")
    return data


_TEXT, _ID = (str,), (str, int)
# The fields each source's records must hold, by type (a JSON loader gives absent fields as None).
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "gsm8k": {"question": _TEXT, "answer": _TEXT},
    "mmlu": {"question": _TEXT, **{f"choice{i}": (str, int, float) for i in range(4)}, "answer": (int, str)},
    "humaneval": {"task_id": _TEXT, "prompt": _TEXT, "test": _TEXT, "entry_point": _TEXT,
                  "canonical_solution": _TEXT},
    "ifeval": {"key": _ID, "prompt": _TEXT, "instruction_id_list": (list,), "kwargs": (list,)},
    "mt_bench": {"question_id": _ID, "category": _TEXT, "turns": (list,)},
    "klue_nli": {"guid": _TEXT, "premise": _TEXT, "hypothesis": _TEXT, "gold_label": _TEXT, "source": _TEXT},
    "kullm": {"id": _ID, "instruction": _TEXT, "instances": (list,), "motivation_app": _TEXT},
}
FIELDS.update(gsm8k_train=FIELDS["gsm8k"], mmlu_dev=FIELDS["mmlu"], komt_bench=FIELDS["mt_bench"])


def _record_problem(key: str, record: Any) -> str | None:
    """What is wrong with one record of ``SOURCES[key]`` (a missing or mistyped field, a value out of
    range), or ``None``."""
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object"
    wrong = [f for f, kinds in FIELDS.get(key, {}).items()
             if not isinstance(record.get(f), kinds) or isinstance(record.get(f), bool)]
    if wrong:
        return f"lacks {', '.join(wrong)} (or holds another type)"
    if key in ("mmlu", "mmlu_dev") and str(record["answer"]) not in ("0", "1", "2", "3"):
        return f"has answer {record['answer']!r}, not a choice index 0-3"
    if key == "klue_nli" and record["gold_label"] not in NLI_IDS:
        return f"has gold_label {record['gold_label']!r}, not one of {', '.join(NLI_IDS)}"
    if key == "ifeval" and len(record["kwargs"]) != len(record["instruction_id_list"]):
        return "has kwargs and instruction_id_list of different lengths"
    if key == "kullm" and not (record["instances"] and isinstance(record["instances"][0], dict)
                               and all(isinstance(record["instances"][0].get(f), str) for f in ("input", "output"))):
        return "has no instance with an input and an output text"
    if key in ("gsm8k", "gsm8k_train") and "####" not in record["answer"]:
        return "has an answer without its '#### <number>' line"
    if key in ("mt_bench", "komt_bench") and not (record["turns"] and all(isinstance(t, str) for t in record["turns"])):
        return "has no turns of text"
    return None


def _read_local(key: str, src: Source, path: Path) -> Any:
    import datasets

    if src.builder == "csv":  # one split per subject: <subject>_<split>.csv
        suffix = "_" + path.name + ".csv"
        files = {p.name[: -len(suffix)]: str(p) for p in sorted(path.glob("*" + suffix))}
        if not files:
            raise DataError(f"{key}: {path} has no *{suffix} files; expected {src.what}")
        # Read every cell as written: no NaN for "None"/"NA", no float for "0.30".
        options = {"features": _MMLU_FEATURES(datasets), "keep_default_na": False, "na_filter": False}
    else:
        files, options = str(path), {}
    try:
        with _quiet(datasets):
            loaded = datasets.load_dataset(src.builder, data_files=files, cache_dir=_cache_dir(), **options)
    except Exception as exc:
        raise DataError(f"{key}: could not read {path} ({type(exc).__name__}: {exc}); "
                        f"expected {src.what}") from exc
    if src.builder == "csv":
        return {subject: split.to_list() for subject, split in loaded.items()}
    return loaded["train"].to_list()


def _MMLU_FEATURES(datasets):
    text = datasets.Value("string")
    return datasets.Features({"question": text, **{f"choice{i}": text for i in range(4)},
                              "answer": datasets.Value("int64")})


def _read_hub(key: str, src: Source, path: Path) -> Any:
    missing = f"{key}: {path} is missing (expected {src.count} {src.what}; see data/README.md)"
    if src.hub is None:
        raise DataError(f"{missing} and no hub copy is known")
    repo, config, split = src.hub
    reachable, why = hub_reachable()
    if not reachable:
        raise DataError(f"{missing}, and the hub copy {repo} cannot be fetched: {why}")
    import datasets

    try:
        with _quiet(datasets):
            rows = datasets.load_dataset(repo, config, split=split, cache_dir=_cache_dir()).to_list()
    except Exception as exc:
        raise DataError(f"{missing}, and loading the hub copy {repo} failed: {exc}") from exc
    return _HUB_ADAPTERS.get(key, list)(rows)


def _mmlu_from_hub(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        row = {"question": r["question"], **{f"choice{i}": c for i, c in enumerate(r["choices"])},
               "answer": r["answer"]}
        out.setdefault(r["subject"], []).append(row)
    return out


def _chat_from_hub(rows: list[dict]) -> list[dict]:
    return [{"question_id": r.get("question_id", r.get("prompt_id")), "category": r.get("category"),
             "turns": r.get("turns") or r.get("prompt"), "reference": r.get("reference")} for r in rows]


def _klue_from_hub(rows: list[dict]) -> list[dict]:
    return [{**r, "gold_label": NLI_IDS[r["label"]]} for r in rows]


_HUB_ADAPTERS = {"mmlu": _mmlu_from_hub, "mmlu_dev": _mmlu_from_hub, "mt_bench": _chat_from_hub,
                 "komt_bench": _chat_from_hub, "klue_nli": _klue_from_hub}


def _cache_dir() -> str:
    root = cache_root()
    return str(root / "datasets")


@contextlib.contextmanager
def _quiet(datasets):
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
