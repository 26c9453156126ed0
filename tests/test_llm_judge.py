"""The optional MT-bench judge, against a fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from dropmatch.errors import ConfigError
from dropmatch.paths import data_dir
from dropmatch.tasks import Example
from dropmatch.tasks.llm_judge import JudgeEndpoint, judge_example, load_judge_prompts, parse_rating

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
