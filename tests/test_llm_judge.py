"""The optional MT-bench judge, against a fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from dropmatch.errors import ConfigError, DataError, JudgeError
from dropmatch.paths import data_dir
from dropmatch.tasks import Example
from dropmatch.tasks.llm_judge import (
    JudgeEndpoint,
    judge_example,
    load_judge_prompts,
    load_reference_answers,
    parse_rating,
)

needs_data = pytest.mark.skipif(not (data_dir() / "mt_bench").is_dir(), reason="benchmark data directory not found")


@pytest.fixture
def fake_judge():
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            rating = 7 if "Assistant A" not in body["messages"][1]["content"] else 4
            reply = {"choices": [{"message": {"role": "assistant", "content": f"Fine. Rating: [[{rating}]]"}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", seen
    server.shutdown()


def test_parse_rating():
    assert parse_rating("so... Rating: [[8]]") == 8.0
    assert parse_rating("Rating: [6.5]") == 6.5
    assert parse_rating("no rating") is None


def test_endpoint_configuration(monkeypatch):
    monkeypatch.delenv("DROPMATCH_JUDGE_URL", raising=False)
    assert JudgeEndpoint.from_env() is None
    monkeypatch.setenv("DROPMATCH_JUDGE_URL", "http://127.0.0.1:1/v1/")
    monkeypatch.delenv("DROPMATCH_JUDGE_MODEL", raising=False)
    with pytest.raises(ConfigError, match="model"):
        JudgeEndpoint.from_env()
    monkeypatch.setenv("DROPMATCH_JUDGE_MODEL", "judge")
    assert JudgeEndpoint.from_env().url == "http://127.0.0.1:1/v1"
    for url in ("localhost:8000/v1", "ftp://host/v1", "http:///v1"):
        with pytest.raises(ConfigError, match="not an http"):
            JudgeEndpoint.from_env(url)


def _server(status: int, body: bytes, seen: list[str]) -> HTTPServer:
    """A server on 127.0.0.1 answering every GET and POST with ``status`` and ``body``; paths go to ``seen``."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(self.path)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # noqa: N815

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status,body,check_error,complete_error", [
    (200, b'{"data": []}', None, "did not answer as an OpenAI-compatible"),
    (404, b"no such route", None, "refused .*/chat/completions \\(HTTP 404"),
    (401, b"bad key", "HTTP 401.*DROPMATCH_JUDGE_API_KEY", "HTTP 401.*DROPMATCH_JUDGE_API_KEY"),
    (200, b'{"choices": [{"message": {"content": null}}]}', None, "did not answer as an OpenAI-compatible"),
])
def test_endpoint_errors_are_clear(status, body, check_error, complete_error):
    """check() passes any server that answers (even without a model list) unless it refuses the key; a
    reply that is not a chat completion, an HTTP error or a refused key is a JudgeError naming the endpoint."""
    seen: list[str] = []
    server = _server(status, body, seen)
    endpoint = JudgeEndpoint(f"http://127.0.0.1:{server.server_port}/v1", "judge")
    try:
        if check_error is None:
            endpoint.check()
        else:
            with pytest.raises(JudgeError, match=check_error):
                endpoint.check()
        with pytest.raises(JudgeError, match=complete_error):
            endpoint.complete("system", "user")
    finally:
        server.shutdown()
    assert seen == ["/v1/models", "/v1/chat/completions"]


def test_unreachable_endpoint_is_a_clear_error():
    endpoint = JudgeEndpoint("http://127.0.0.1:1/v1", "judge")  # port 1: nothing listens
    for call in (endpoint.check, lambda: endpoint.complete("system", "user")):
        with pytest.raises(JudgeError, match="http://127.0.0.1:1/v1 is not reachable"):
            call()


@needs_data
def test_cli_run_checks_the_judge_before_the_models_load(tmp_path, capsys):
    from dropmatch import cli

    # a missing model proves nothing loads before the judge's checks
    base = ["run", "--target", "no-such-org/no-such-model", "--draft", "ngram", "--out", str(tmp_path / "r.jsonl"),
            "--judge-model", "judge"]
    assert cli.main([*base, "--task", "mt_bench", "--judge-url", "http://127.0.0.1:1/v1"]) == 2
    assert "http://127.0.0.1:1/v1 is not reachable" in capsys.readouterr().err
    assert cli.main([*base, "--task", "gsm8k", "--judge-url", "http://127.0.0.1:1/v1"]) == 2
    assert "no judge prompts for task 'gsm8k'" in capsys.readouterr().err
    assert cli.main([*base, "--task", "mt_bench", "--judge-url", "http://127.0.0.1:1/v1",
                     "--data-dir", str(tmp_path)]) == 2
    assert "no judge prompts at" in capsys.readouterr().err
    with pytest.raises(DataError):
        load_judge_prompts("mt_bench", tmp_path)


@needs_data
def test_run_task_judges_with_the_prompts_of_its_data_directory(tiny, fake_judge, tmp_path, monkeypatch):
    """``--data-dir`` reaches the judge prompts too, not only the questions (the default directory is
    empty here)."""
    import shutil

    from dropmatch.methods import Decoder, MethodConfig
    from dropmatch.runner import run_task

    shutil.copytree(data_dir() / "mt_bench", tmp_path / "data" / "mt_bench")
    monkeypatch.setenv("DROPMATCH_DATA", str(tmp_path / "empty"))
    url, seen = fake_judge
    records = run_task(Decoder(tiny, MethodConfig("sd")), "mt_bench", tmp_path / "r.jsonl", limit=1,
                       max_new_tokens=4, progress=False, data_dir=tmp_path / "data",
                       llm_judge=JudgeEndpoint(url, "judge-model"))
    assert len(seen) == 2 and records[0]["score"]["judge_score"] == 5.5


@needs_data
def test_judge_example_grades_both_turns(fake_judge):
    url, seen = fake_judge
    endpoint = JudgeEndpoint(url, "judge-model")
    prompts = load_judge_prompts("mt_bench")
    example = Example("mt_bench/81", "mt_bench", None, ["Write a haiku.", "Now in French."], None,
                      {"category": "writing"})
    scores = judge_example(endpoint, prompts, example, ["An answer.", "Une réponse."])
    assert scores == {"judge_turn_1": 7.0, "judge_turn_2": 4.0, "judge_score": 5.5}
    assert seen[0]["model"] == "judge-model" and "Write a haiku." in seen[0]["messages"][1]["content"]
    math = Example("mt_bench/111", "mt_bench", None, ["2+2?", "3+3?"], ["4", "6"], {"category": "math"})
    judge_example(endpoint, prompts, math, ["4", "6"])
    assert "Reference" in seen[-1]["messages"][1]["content"]
    assert set(load_judge_prompts("komt_bench")) >= {"single-v1", "single-math-v1-multi-turn"}


@needs_data
@pytest.mark.parametrize("task", ["mt_bench", "komt_bench"])
def test_reference_questions_are_judged_against_gpt4_answers(fake_judge, task):
    """FastChat grades math, reasoning and coding answers against GPT-4's answers to both turns
    (reference_answer/gpt-4.jsonl), not the questions' short reference field ("5pi")."""
    from dropmatch.tasks import load_task

    url, seen = fake_judge
    question = next(e for e in load_task(task) if e.metadata["question_id"] == 111)
    references = load_reference_answers(task)
    assert len(references[111]) == 2 and len(references) >= 30
    judge_example(JudgeEndpoint(url, "judge"), load_judge_prompts(task), question, ["4", "6"], references)
    turn_1, turn_2 = (body["messages"][1]["content"] for body in seen)
    assert references[111][0] in turn_1 and references[111][1] in turn_2
    assert question.reference[1] not in turn_2.replace(references[111][1], "")  # the short "5pi" is not the reference


def test_without_reference_answers_the_short_reference_stands_in_with_a_warning(fake_judge, tmp_path):
    url, seen = fake_judge
    with pytest.warns(UserWarning, match="not comparable"):
        assert load_reference_answers("mt_bench", tmp_path) == {}
    prompts = {name: {"system_prompt": "S", "prompt_template": "{question} [ref: {ref_answer_1}]"}
               for name in ("single-math-v1", "single-math-v1-multi-turn")}
    math = Example("mt_bench/111", "mt_bench", None, ["Area?", "Circle?"], ["Area is 3", "5pi"],
                   {"category": "math", "question_id": 111})
    judge_example(JudgeEndpoint(url, "judge"), prompts, math, ["3", "5pi"], {})
    assert "[ref: Area is 3]" in seen[0]["messages"][1]["content"]


@pytest.mark.parametrize("content", [b"not json\n", b'{"question_id": 1}\n', b'{"question_id": 1, "choices": []}\n'])
def test_malformed_reference_answers_are_a_data_error(tmp_path, content):
    from dropmatch.tasks.llm_judge import REFERENCE_FILES

    path = tmp_path / REFERENCE_FILES["mt_bench"]
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(DataError, match="reference answers"):
        load_reference_answers("mt_bench", tmp_path)


def test_an_endpoint_that_does_not_speak_http_is_a_clear_error():
    import socket

    with socket.socket() as server:  # answers every connection with an SSH banner, as port 22 does
        server.bind(("127.0.0.1", 0))
        server.listen(4)

        def banner():
            for _ in range(2):
                conn, _ = server.accept()
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.close()

        threading.Thread(target=banner, daemon=True).start()
        endpoint = JudgeEndpoint(f"http://127.0.0.1:{server.getsockname()[1]}/v1", "judge")
        for call in (endpoint.check, lambda: endpoint.complete("system", "user")):
            with pytest.raises(JudgeError, match="is not reachable"):
                call()


@pytest.mark.parametrize("content", [b"not json\n", b'{"name": "x"}\n[1, 2]\n', b"\xff\xfe\n"])
def test_malformed_judge_prompts_are_a_data_error(tmp_path, content):
    from dropmatch.errors import DataError
    from dropmatch.tasks.llm_judge import PROMPT_FILES, load_judge_prompts

    path = tmp_path / PROMPT_FILES["mt_bench"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    with pytest.raises(DataError, match="judge prompts"):
        load_judge_prompts("mt_bench", tmp_path)
