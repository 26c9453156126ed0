"""Caches keyed by every parameter that changes a result: a new parameter starts anew, the same resumes."""

from __future__ import annotations

import pytest

from dropmatch.judge_mining import mine
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.paths import data_dir
from dropmatch.runner import file_digest, keyed_path, read_results, run_task

needs_data = pytest.mark.skipif(not (data_dir() / "mmlu").is_dir(), reason="benchmark data directory not found")


def _lines(path) -> int:
    return len(path.read_text().splitlines())


def test_keyed_path_names_seed_and_budget_and_hashes_the_rest(tmp_path):
    base = {"task": "gsm8k", "seed": 0, "max_new_tokens": 48, "config": {"k": 5}}
    path = keyed_path(tmp_path / "gsm8k__pair__sd.jsonl", base)
    assert path.name.startswith("gsm8k__pair__sd__seed0-new48-") and path.suffix == ".jsonl"
    assert path == keyed_path(tmp_path / "gsm8k__pair__sd.jsonl", dict(reversed(base.items())))
    others = [{**base, "seed": 1}, {**base, "max_new_tokens": 64}, {**base, "config": {"k": 3}}]
    assert len({path, *(keyed_path(tmp_path / "gsm8k__pair__sd.jsonl", o) for o in others)}) == 4
    judge = tmp_path / "judge.joblib"
    assert file_digest(judge) is None
    judge.write_bytes(b"one")
    first = file_digest(judge)
    judge.write_bytes(b"two")  # retrained in place: results decoded with the old judge are not reused
    assert first != file_digest(judge) is not None


@needs_data
def test_a_changed_seed_or_budget_gets_its_own_file_and_the_same_parameters_resume(tiny, tmp_path, one_thread):
    out = tmp_path / "klue.jsonl"
    decoder = Decoder(tiny, MethodConfig("sd"))

    def run(seed=0, max_new_tokens=4):
        return run_task(decoder, "klue_nli", out, limit=2, seed=seed, max_new_tokens=max_new_tokens,
                        progress=False, warmup=False, keyed=True)

    first = run(seed=0)
    run(seed=1)  # once "another run ... use another --out"
    files = sorted(tmp_path.glob("klue__*.jsonl"))
    assert len(files) == 2 and not out.exists()
    again = run(seed=0)
    assert [r["output"] for r in again] == [r["output"] for r in first]
    assert sorted(_lines(f) for f in files) == [2, 2]  # resumed: nothing duplicated
    run(seed=0, max_new_tokens=5)
    assert len(list(tmp_path.glob("klue__*.jsonl"))) == 3


def test_mining_reuses_only_records_of_the_same_settings(tiny, tmp_path, one_thread):
    out = tmp_path / "mined.jsonl"
    problems = [("p0", "Question: 1 + 1?\nAnswer:")]

    def run(**kw):
        return mine(tiny, problems, out, answer=lambda text: text.strip()[-1:] or None, max_new_tokens=6,
                    progress=False, **kw)

    run(max_mismatches=1)
    assert _lines(out) == 1
    run(max_mismatches=1)
    assert _lines(out) == 1  # resumed
    run(max_mismatches=2)  # another cap: mined anew, not the stale labels
    records = read_results(out)
    assert len(records) == 2 and [r["settings"]["max_mismatches"] for r in records] == [1, 2]
    assert len(run(max_mismatches=2)) <= 2 and _lines(out) == 2
