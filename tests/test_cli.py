"""The command line, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dropmatch", *args], capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("method", ["ar", "sd", "dropmatch", "topk", "typical", "divergence"])
def test_generate_json_is_one_object_on_stdout(method):
    out = run("generate", "--pair", "tiny", "--method", method, "--draft-len", "4", "--max-new-tokens", "24",
              "--temperature", "0", "--seed", "0", "--prompt", "Hello there", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one object: anything else fails to parse
    assert set(result) == {"text", "token_ids", "stats"}
    stats = result["stats"]
    for key in ("new_tokens", "target_calls", "tau", "accepted_per_step", "wall_s", "tokens_per_s", "extra_accepts"):
        assert key in stats
    assert stats["new_tokens"] == len(result["token_ids"]) == 24
    if method == "ar":
        assert stats["tau"] == 1.0
    if method == "sd":
        assert stats["extra_accepts"] == 0


def test_ngram_drafter_and_prompt_file(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("abc abc abc abc")
    out = run("generate", "--pair", "tiny", "--method", "sd", "--draft", "ngram", "--prompt-file", str(prompt),
              "--max-new-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["new_tokens"] == 16


@pytest.mark.parametrize("args,message", [
    (["--method", "dropmatch", "--k", "0"], "K"),
    (["--method", "dropmatch", "--p-drop", "1.5"], "p_drop"),
    (["--method", "dropmatch", "--criterion", "vote"], "criterion"),
    (["--max-new-tokens", "9000"], "context"),
    (["--draft", "some/model"], "--target"),
    (["--draft-head", "some/head"], "--draft eagle3"),  # was ignored
    (["--device-map", "auto"], "device_map applies to hub models"),  # was ignored
    (["--top-p", "0.9"], "--temperature > 0"),  # was ignored: greedy takes the argmax
    (["--method", "ar", "--draft", "ngram"], "--method ar decodes without a draft: --draft ngram"),  # was ignored
    (["--method", "ar", "--draft", "eagle3", "--draft-head", "no/head"], "--draft eagle3, --draft-head"),
    (["--method", "ar", "--lookup-first"], "--lookup-first needs a speculative method"),
])
def test_bad_input_is_a_clear_error(args, message):
    out = run("generate", "--pair", "tiny", "--prompt", "hi", *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_a_benchmark_script_reports_bad_input_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "dropmatch.benchmarks.engine", "--lookup-guide", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "error: " in out.stderr and "--lookup-guide" in out.stderr and "Traceback" not in out.stderr


def test_unknown_model_offline():
    out = run("generate", "--target", "no-such-org/no-such-model", "--draft", "no-such-org/x", "--prompt", "hi",
              env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "local" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("content,message", [
    (b"", "holds no prompts"),
    (b'{"prompt": "a"}\n[1, 2]\n', "p.jsonl:2: each line must be a JSON object"),
    (b'{"text": "a"}\n', "p.jsonl:1: each line must be a JSON object with a string field 'prompt'"),
    (b'{"prompt": "a"\n', "p.jsonl:1: not a JSON object"),
    (b"\xff\xfe prompt\n", "not UTF-8 text"),
])
def test_malformed_prompts_file_is_a_clear_error_before_models_load(tmp_path, capsys, content, message):
    from dropmatch import cli

    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    # the tiny pair would load in well under a second; a missing model proves nothing loads first
    argv = ["fidelity", "--target", "no-such-org/no-such-model", "--draft", "ngram", "--prompts", str(path)]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert cli.main(["generate", "--pair", "tiny", "--prompt-file", str(tmp_path)]) == 2  # a directory
    assert "it is a directory" in capsys.readouterr().err


def test_malformed_mined_file_is_a_clear_error(tmp_path, capsys):
    from dropmatch import cli

    mined = tmp_path / "mined.jsonl"
    mined.write_text('{"problem": "p1", "mismatches": [{"position": 3}]}\n')
    assert cli.main(["judge", "train", "--mined", str(mined), "--out", str(tmp_path / "j.joblib")]) == 2
    assert "problem 'p1' has no list of mismatches with the fields" in capsys.readouterr().err
    assert cli.main(["judge", "train", "--mined", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "j")]) == 2
    assert "no mined file at" in capsys.readouterr().err
    assert not (tmp_path / "j.joblib").exists()


def test_generate_fidelity_compares_with_the_targets_autoregressive_output():
    """sd and ar give the same greedy tokens (the invariant), so both match the reference exactly; the
    reference is AR's output and its NLL, not the method's own output decoded again."""
    outputs = {}
    for method in ("ar", "sd", "dropmatch"):
        out = run("generate", "--pair", "tiny", "--method", method, "--max-new-tokens", "16", "--temperature", "0",
                  "--prompt", "Hello there", "--json", "--fidelity")
        assert out.returncode == 0, out.stderr
        outputs[method] = json.loads(out.stdout)
    reference = outputs["ar"]["fidelity"]
    assert reference["exact_match"] and outputs["sd"]["fidelity"]["exact_match"]
    assert outputs["sd"]["fidelity"]["greedy_nll"] == pytest.approx(reference["greedy_nll"])
    dropmatch = outputs["dropmatch"]["fidelity"]
    assert dropmatch["greedy_nll"] == pytest.approx(reference["greedy_nll"])
    assert dropmatch["exact_match"] == (outputs["dropmatch"]["token_ids"] == outputs["ar"]["token_ids"])
