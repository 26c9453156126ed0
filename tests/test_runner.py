"""The benchmark runner: resumable JSON lines, environment records, the summary table."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dropmatch.errors import ConfigError
from dropmatch.intervals import bootstrap_ci
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.paths import data_dir
from dropmatch.runner import TaskRunner, lock_path, read_results, results_lock, run_task
from dropmatch.summarize import summarize_files, summarize_records
from dropmatch.tasks import load_task

pytestmark = pytest.mark.skipif(not (data_dir() / "mmlu").is_dir(), reason="benchmark data directory not found")

RUN = ["run", "--pair", "tiny", "--task", "klue_nli", "--method", "dropmatch", "--limit", "8",
       "--max-new-tokens", "6", "--fidelity"]


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dropmatch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


HOLD_LOCK = """
import sys
from dropmatch.runner import results_lock
with results_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()  # hold it until the test closes stdin (or kills this process)
"""


def _lock_holder(out) -> subprocess.Popen:
    """Another process holding the writer's lock on ``out`` (it has it once this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def _refused_by(pid: int, out) -> str:
    return rf"{re.escape(str(out))} is being written by another run \(pid {pid}\b"


def test_killed_run_resumes_to_the_same_results(tmp_path):
    whole, killed = tmp_path / "whole.jsonl", tmp_path / "killed.jsonl"
    assert _cli(*RUN, "--out", str(whole)).wait(timeout=600) == 0
    proc = _cli(*RUN, "--out", str(killed))
    deadline = time.time() + 300
    while _lines(killed) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 2 <= _lines(killed) < 8
    with killed.open("a") as f:  # a torn line, as if killed mid-write
        f.write('{"id": "klue-nli-v1_dev_0000')
    assert _cli(*RUN, "--out", str(killed)).wait(timeout=600) == 0
    a, b = read_results(whole), read_results(killed)
    assert [r["id"] for r in b] == [r["id"] for r in a]  # same examples, same order, no duplicates
    for x, y in zip(a, b, strict=True):
        assert (x["output"], x["score"], x["fidelity"]["exact_match"]) == (y["output"], y["score"],
                                                                          y["fidelity"]["exact_match"])
        assert x["stats"]["accepted_per_step"] == y["stats"]["accepted_per_step"]
    env = json.loads((tmp_path / "killed.jsonl.env.json").read_text())
    assert {"packages", "device", "threads", "git_revision"} <= set(env)


def test_other_configuration_is_refused(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    run_task(Decoder(tiny, MethodConfig("sd")), "klue_nli", out, limit=1, max_new_tokens=4, progress=False)
    with pytest.raises(ConfigError, match="another run"):
        run_task(Decoder(tiny, MethodConfig("dropmatch")), "klue_nli", out, limit=2, max_new_tokens=4,
                 progress=False)


def test_chat_task_two_turns_and_summary(tiny, tmp_path):
    sd, dm = tmp_path / "sd.jsonl", tmp_path / "dm.jsonl"
    run_task(Decoder(tiny, MethodConfig("sd")), "mt_bench", sd, limit=2, max_new_tokens=8, progress=False)
    records = run_task(Decoder(tiny, MethodConfig("dropmatch")), "mt_bench", dm, limit=2, max_new_tokens=8,
                       fidelity=True, progress=False)
    assert len(records) == 2 and all(len(r["output"]) == 2 for r in records)
    assert all(len(r["fidelity"]["turns"]) == 2 for r in records)
    rows = summarize_files([sd, dm])
    by_method = {r["method"].split("(")[0].split("@")[0]: r for r in rows}
    assert by_method["sd"]["speedup"] == 1.0
    assert by_method["dropmatch"]["n"] == 2 and "exact_match_rate" in by_method["dropmatch"]
    out = subprocess.run([sys.executable, "-m", "dropmatch", "summarize", str(sd), str(dm)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "| mt_bench |" in out.stdout


def test_bootstrap_interval():
    low, high = bootstrap_ci([0, 1] * 50)
    assert low < 0.5 < high and high - low < 0.25
    assert bootstrap_ci([1.0] * 10) == (1.0, 1.0)


def test_resume_refuses_a_different_budget_and_returns_only_this_runs_examples(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    decoder = Decoder(tiny, MethodConfig("sd"))
    assert len(run_task(decoder, "klue_nli", out, limit=3, max_new_tokens=4, progress=False)) == 3
    assert [r["id"] for r in run_task(decoder, "klue_nli", out, limit=2, max_new_tokens=4, progress=False)] == \
        [r["id"] for r in read_results(out)[:2]]
    with pytest.raises(ConfigError, match="max_new_tokens"):
        run_task(decoder, "klue_nli", out, limit=3, max_new_tokens=5, progress=False)


def test_summary_speedup_uses_the_baseline_at_the_same_draft_length():
    def record(method, tps):
        return {"task": "gsm8k", "method": method, "score": {"exact_match": 0.0},
                "stats": {"new_tokens": 10, "target_calls": 5, "tokens_per_s": tps}}

    from dropmatch.summarize import summarize_records

    rows = {r["method"]: r for r in summarize_records([record("sd@L5", 10.0), record("sd@L10", 20.0),
                                                        record("dropmatch(x)@L5", 15.0)])}
    assert rows["dropmatch(x)@L5"]["speedup"] == 1.5 and rows["sd@L10"]["speedup"] == 1.0


@pytest.mark.parametrize("task", ["gsm8k", "mmlu", "humaneval", "ifeval", "klue_nli", "mt_bench", "komt_bench",
                                  "kullm"])
def test_summary_headline_score_is_one_the_task_metric_produces(task):
    from dropmatch.summarize import PRIMARY_SCORE, summarize_records
    from dropmatch.tasks import load_task, score

    example = load_task(task, limit=1)[0]
    result = score(example, "The answer is A.\n#### 3")
    assert PRIMARY_SCORE[task] in result
    record = {"task": task, "method": "sd", "score": result,
              "stats": {"new_tokens": 4, "target_calls": 2, "tokens_per_s": 1.0}}
    (row,) = summarize_records([record])
    assert row["mean"] == result[PRIMARY_SCORE[task]]


def test_summary_refuses_a_missing_headline_score():
    from dropmatch.summarize import summarize_records

    record = {"task": "gsm8k", "method": "sd", "score": {"something_else": 1.0},
              "stats": {"new_tokens": 4, "target_calls": 2, "tokens_per_s": 1.0}}
    with pytest.raises(ConfigError, match="exact_match"):
        summarize_records([record])


def test_a_second_writer_is_refused_while_another_process_writes_the_file(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    decoder = Decoder(tiny, MethodConfig("sd"))
    holder = _lock_holder(out)
    try:
        assert lock_path(out).read_text().strip() == str(holder.pid)
        start = time.monotonic()
        with pytest.raises(ConfigError, match=_refused_by(holder.pid, out)):
            run_task(decoder, "klue_nli", out, limit=1, max_new_tokens=4, progress=False)
        assert time.monotonic() - start < 5.0  # refused at once, not after waiting
        assert not out.exists() and not (tmp_path / "r.jsonl.env.json").exists()  # nothing written
    finally:
        holder.stdin.close()
    assert holder.wait(timeout=60) == 0
    records = run_task(decoder, "klue_nli", out, limit=1, max_new_tokens=4, progress=False)
    assert len(records) == 1 and len(read_results(out)) == 1


def test_a_killed_writer_releases_the_file_and_readers_need_no_lock(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    decoder = Decoder(tiny, MethodConfig("sd"))
    run_task(decoder, "klue_nli", out, limit=1, max_new_tokens=4, progress=False)
    holder = _lock_holder(out)
    try:
        assert len(read_results(out, repair=False)) == 1  # readers go on while a writer holds the lock
        assert summarize_files([out])[0]["n"] == 1
        with pytest.raises(ConfigError, match=_refused_by(holder.pid, out)):
            run_task(decoder, "klue_nli", out, limit=2, max_new_tokens=4, progress=False)
        assert len(read_results(out)) == 1
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # dies holding it: the kernel drops the flock
        holder.wait()
    assert [r["id"] for r in run_task(decoder, "klue_nli", out, limit=2, max_new_tokens=4, progress=False)] == \
        [r["id"] for r in read_results(out)]
    assert len(read_results(out)) == 2


def test_the_writers_lock_excludes_a_second_holder_in_the_same_process(tmp_path):
    out = tmp_path / "r.jsonl"
    with results_lock(out) as path:
        assert path == tmp_path / "r.jsonl.lock" and path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError, match=_refused_by(os.getpid(), out)), results_lock(out):
            pass
    assert lock_path(out).read_text() == ""  # released: no stale pid left behind
    with results_lock(out):
        pass


@pytest.mark.parametrize("content", [b"my precious notes\n", b"my precious notes", b'{"id": "a"}\nnot json\n',
                                     b"[1, 2]\n", b"null\n", b"\xff\xfe notes\n", b'{"no_id": 1}\n'])
def test_a_file_that_is_not_a_results_file_is_refused_and_left_untouched(tmp_path, content):
    out = tmp_path / "notes.txt"
    out.write_bytes(content)
    with pytest.raises(ConfigError, match="not a results record"):
        read_results(out, key="id")
    assert out.read_bytes() == content


def test_only_a_torn_record_at_the_end_is_cut(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_bytes(b'{"id": "a"}\n{"id": "b", "out')
    assert read_results(out, key="id") == [{"id": "a"}]
    assert out.read_bytes() == b'{"id": "a"}\n'


def test_summarizing_a_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such results file"):
        summarize_files([tmp_path / "none.jsonl"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no results"):
        summarize_files([tmp_path / "empty.jsonl"])


def _timed(method: str, example: int, tokens_per_s: float, **settings) -> dict:
    """A GSM8K record of ``method`` on prompt ``example`` decoding 40 tokens after the first at ``tokens_per_s``."""
    stats = {"new_tokens": 41, "target_calls": 11, "generations": 1, "prefill_s": 0.5,
             "wall_s": 0.5 + 40 / tokens_per_s, "tokens_per_s": 41 / (0.5 + 40 / tokens_per_s)}
    return {"id": f"gsm8k/{example}", "task": "gsm8k", "method": method, "score": {"exact_match": 1.0},
            "stats": stats, "model": "tiny", "max_new_tokens": 64, "seed": 0, **settings}


def test_summary_never_pools_runs_of_other_settings_and_pairs_each_with_its_own_baseline():
    greedy, hot = {"temperature": 0.0, "top_p": 1.0}, {"temperature": 1.0, "top_p": 1.0}
    records = [_timed(m, i, speed, sampling=sampling) for i in range(5)
               for m, speed, sampling in (("sd@L5", 10.0, greedy), ("sd@L5", 10.0, hot),
                                          ("dropmatch(x)@L5", 15.0, greedy), ("dropmatch(x)@L5", 5.0, hot))]
    rows = summarize_records(records)
    assert len(rows) == 4 and all(r["n"] == 5 for r in rows)
    by_label = {r["method"]: r for r in rows}
    assert len(by_label) == 4  # the labels name the differing setting
    speedups = sorted(r["speedup"] for r in rows if r["method"].startswith("dropmatch"))
    assert speedups == pytest.approx([0.5, 1.5])  # pooled and paired blindly: one row, n = 10, speedup ~1
    assert all('"temperature": 1.0' in m or '"temperature": 0.0' in m for m in by_label)


def test_summary_pairs_a_run_from_a_cached_prompt_prefix_with_a_baseline_from_the_same():
    cold, cached = {"prompt_prefix": None}, {"prompt_prefix": "1291 tokens c799db427d"}
    records = [_timed(m, i, speed, **prefix) for i in range(3)
               for m, speed, prefix in (("sd@L5", 10.0, cold), ("sd@L5", 20.0, cached), ("dropmatch(x)@L5", 20.0, cached))]
    rows = summarize_records(records)
    assert len(rows) == 3 and all(r["n"] == 3 for r in rows)
    (dropmatch,) = [r for r in rows if r["method"].startswith("dropmatch")]
    assert dropmatch["speedup"] == pytest.approx(1.0)  # against the cached sd run, not the cold one (2.0)
    old = dict(_timed("sd@L5", 0, 10.0))  # records written before prefixes: none
    assert summarize_records([old, _timed("sd@L5", 1, 10.0, **cold)])[0]["n"] == 2


def test_summary_compares_with_the_baseline_of_the_same_seed_and_refuses_a_prompt_twice():
    records = [_timed(m, i, speed, seed=seed) for i in range(3)
               for m, speed, seed in (("sd@L5", 10.0, 0), ("sd@L5", 20.0, 1), ("dropmatch(x)@L5", 20.0, 1))]
    rows = {r["method"]: r for r in summarize_records(records)}
    assert rows["dropmatch(x)@L5"]["speedup"] == pytest.approx(1.0)  # against sd at seed 1, not seed 0
    with pytest.raises(ConfigError, match="more than once"):
        summarize_records(records + records[:1])


def test_summarizing_a_file_of_other_results_is_a_clear_error(tmp_path):
    other = tmp_path / "dropout_paths.jsonl"
    other.write_text(json.dumps({"id": "gsm8k/0", "agreement": 0.5}) + "\n")
    with pytest.raises(ConfigError, match="no decoding results"):
        summarize_files([other])
    out = subprocess.run([sys.executable, "-m", "dropmatch", "summarize", str(other)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr and "no decoding results" in out.stderr


def test_resume_refuses_other_chat_template_or_llm_judge_settings(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    decoder = Decoder(tiny, MethodConfig("sd"))
    run_task(decoder, "mt_bench", out, limit=1, max_new_tokens=4, progress=False)
    assert read_results(out)[0]["chat_template"] is False and read_results(out)[0]["llm_judge"] is None
    with pytest.raises(ConfigError, match="chat_template"):
        run_task(decoder, "mt_bench", out, limit=2, max_new_tokens=4, chat_template=True, progress=False)

    class Judge:  # never called: the run is refused before any example
        model = "some-judge"

    with pytest.raises(ConfigError, match="llm_judge"):
        run_task(decoder, "mt_bench", out, limit=2, max_new_tokens=4, llm_judge=Judge(), progress=False)


def test_chat_template_leaves_single_prompt_tasks_their_bos(tiny):
    example = load_task("klue_nli", limit=1)[0]
    decoder = Decoder(tiny, MethodConfig("sd"))
    plain = TaskRunner(decoder, "klue_nli").encode(tiny, example)
    assert plain[0] == tiny.tokenizer.bos_token_id
    assert TaskRunner(decoder, "klue_nli", chat_template=True).encode(tiny, example) == plain


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_a_new_token_budget_below_one_is_refused(tiny, tmp_path, budget):
    with pytest.raises(ConfigError, match="max_new_tokens"):
        run_task(Decoder(tiny, MethodConfig("sd")), "klue_nli", tmp_path / "r.jsonl", limit=1,
                 max_new_tokens=budget, progress=False)
    assert not (tmp_path / "r.jsonl").exists() or not read_results(tmp_path / "r.jsonl")


def test_an_interval_over_prompts_that_all_agree_is_the_exact_binomial_one():
    # the bootstrap of n equal values has no spread; with the values' range known, the interval is the
    # Clopper-Pearson bound on the share of prompts that could lie elsewhere (scipy's exact interval)
    from scipy.stats import binomtest

    for n in (5, 30):
        exact_low = binomtest(n, n).proportion_ci(confidence_level=0.95, method="exact").low
        assert bootstrap_ci([1.0] * n, bounds=(0.0, 1.0)) == pytest.approx((exact_low, 1.0))
        assert bootstrap_ci([0.0] * n, bounds=(0.0, 1.0)) == pytest.approx((0.0, 1.0 - exact_low))
        assert bootstrap_ci([0.0] * n, bounds=(-100.0, 100.0)) == pytest.approx((-100 * (1 - exact_low),
                                                                                100 * (1 - exact_low)))
    assert bootstrap_ci([0.25] * 5) == (0.25, 0.25)  # no range given: the bootstrap's own interval
    low, high = bootstrap_ci([0, 1] * 50, bounds=(0.0, 1.0))  # values that vary: the bootstrap, as before
    assert (low, high) == bootstrap_ci([0, 1] * 50)
