"""The sandbox against hostile programs. Each hostile program is bounded on its own (at most 64
processes, loopback only, files under pytest's tmp dir or a unique /tmp name), so the host stays
safe even if a limit failed; the tests then check that the limit did hold.

Several programs go around the Python-level guards with ctypes (raw fork/unlink/socket calls), so
what is tested is the kernel-level layer: rlimits, namespaces, read-only mounts, uid nobody.
"""

from __future__ import annotations

import os
import socket
import textwrap
import time
import uuid

import pytest

from dropmatch.tasks import metrics
from dropmatch.tasks.sandbox import Limits, isolation_layers, run_python

LAYERS = isolation_layers()
needs_namespaces = pytest.mark.skipif("namespaces" not in LAYERS, reason="unshare (network/PID/mount namespaces) "
                                      "does not work on this machine")
needs_nproc = pytest.mark.skipif("nobody" not in LAYERS, reason="RLIMIT_NPROC is only exact when root runs the "
                                 "program as nobody")
FAST = Limits(timeout_s=3.0)


def program(source: str) -> str:
    return textwrap.dedent(source).strip() + "\n"


def processes_mentioning(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


# --- ordinary programs -----------------------------------------------------------------------

def test_passing_and_failing_programs():
    ok = run_python("import math\nprint(math.factorial(5))\n")
    assert ok.passed and ok.status == "passed" and ok.stdout == "120\n" and ok.returncode == 0
    boom = run_python("raise ValueError('boom')\n")
    assert boom.status == "failed" and "ValueError: boom" in boom.stderr
    assert run_python("def f(:\n").status == "failed"
    early = run_python("import sys\nsys.exit(0)\nraise SystemExit\n")
    assert early.status == "failed" and "exit()" in early.stderr  # exiting early is not passing


def test_environment_is_scrubbed_stdin_closed_and_workdir_fresh(monkeypatch):
    monkeypatch.setenv("DROPMATCH_TEST_SECRET", "do-not-leak")
    result = run_python(program("""
        import os, sys
        print(sorted(os.environ))
        print(repr(sys.stdin.read()))
        print(os.listdir("."))
        open("scratch.txt", "w").write("x" * 1000)
        print(os.getcwd())
    """))
    assert result.passed, result.stderr
    env_line, stdin_line, listing, cwd = result.stdout.splitlines()
    assert "DROPMATCH_TEST_SECRET" not in env_line and "do-not-leak" not in result.stdout
    assert stdin_line == "''" and listing == "[]"
    assert not os.path.exists(cwd)  # the work dir is gone afterwards
    assert result.run_id in cwd


def test_output_is_capped():
    result = run_python("import sys\nsys.stdout.write('x' * 5_000_000)\nsys.stderr.write('e' * 300_000)\n",
                        Limits(max_output_bytes=1000))
    assert result.passed and len(result.stdout) == 1000 and len(result.stderr) == 1000


# --- hostile programs ------------------------------------------------------------------------

def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", Limits(timeout_s=2.0))
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - start < 4.0
    assert processes_mentioning(result.run_id) == []


def test_cpu_limit_stops_a_busy_loop_before_the_wall_clock():
    result = run_python("while True:\n    pass\n", Limits(timeout_s=20.0, cpu_s=1))
    assert result.status == "timeout" and result.duration_s < 5.0


def test_sleeping_child_processes_are_killed_too():
    result = run_python(program("""
        import ctypes, os, time
        libc = ctypes.CDLL(None)
        if libc.fork() == 0:
            libc.setsid()  # try to leave the process group
            time.sleep(60)
        time.sleep(60)
    """), Limits(timeout_s=1.5))
    assert result.status == "timeout"
    assert processes_mentioning(result.run_id) == []


def test_bounded_fork_bomb_is_contained():
    # A binary tree of depth 6: at most 64 processes even with no limit at all.
    result = run_python(program("""
        import ctypes, os, time
        libc = ctypes.CDLL(None)
        for _ in range(6):
            if libc.fork() < 0:
                break
        os.write(1, b"alive\\n")
        time.sleep(60)
    """), FAST)
    assert not result.passed and result.status == "timeout"
    alive = result.stdout.count("alive")
    assert 1 <= alive <= 64
    if "nobody" in LAYERS:
        assert alive <= Limits().max_processes
    assert processes_mentioning(result.run_id) == []
    assert not run_python("import os\nos.fork()\n").passed  # the Python-level guard, too


def test_huge_allocations_fail():
    big = run_python("x = bytearray(8 << 30)\n")
    assert big.status == "failed" and "MemoryError" in big.stderr
    touched = run_python("chunks = [bytearray(64 << 20) for _ in range(64)]\n", Limits(memory_bytes=512 << 20))
    assert touched.status == "failed" and "MemoryError" in touched.stderr


@pytest.mark.parametrize("how", ["python", "ctypes"])
def test_files_outside_the_workdir_survive(tmp_path, how):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me")
    stray = f"/tmp/dropmatch-sandbox-test-{uuid.uuid4().hex}"
    if how == "python":
        attack = f"""
            import os, shutil
            for name, act in (("remove", lambda: os.remove({str(sentinel)!r})),
                              ("rmtree", lambda: shutil.rmtree({str(tmp_path)!r})),
                              ("overwrite", lambda: open({str(sentinel)!r}, "w").write("owned")),
                              ("create", lambda: open({str(tmp_path / "new.txt")!r}, "w").write("x")),
                              ("stray", lambda: open({stray!r}, "w").write("x"))):
                try:
                    act()
                    print(name, "done")
                except Exception:
                    print(name, "refused")
        """
    else:
        attack = f"""
            import ctypes
            libc = ctypes.CDLL(None)
            print("remove", libc.unlink({str(sentinel).encode()!r}))
            print("rmdir", libc.rmdir({str(tmp_path).encode()!r}))
            print("overwrite", libc.open({str(sentinel).encode()!r}, 0o1001))
            print("create", libc.open({str(tmp_path / "new.txt").encode()!r}, 0o101, 0o644))
            print("stray", libc.open({stray.encode()!r}, 0o101, 0o644))
        """
    result = run_python(program(attack), FAST)
    try:
        assert result.passed, result.stderr
        outcome = dict(line.split() for line in result.stdout.splitlines())
        assert sentinel.read_text() == "keep me"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sentinel.txt"]
        refused = {"refused", "-1"}
        assert all(v in refused for k, v in outcome.items() if k != "stray"), outcome
        if "namespaces" in LAYERS:  # /tmp is world-writable: only the read-only mount keeps it clean
            assert outcome["stray"] in refused and not os.path.exists(stray)
    finally:
        if os.path.exists(stray):
            os.remove(stray)


def test_python_level_network_guard():
    result = run_python(program("""
        import socket
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1)
        except PermissionError as exc:
            print("refused", exc)
    """))
    assert result.passed and "refused" in result.stdout


@needs_namespaces
def test_no_network_even_around_python():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        result = run_python(program(f"""
            import ctypes, socket, struct
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
            addr = struct.pack("<HH4s8x", socket.AF_INET, socket.htons({port}), bytes([127, 0, 0, 1]))
            rc = libc.connect(fd, addr, len(addr))
            print("connect", rc, ctypes.get_errno())
            assert rc == 0, "no connection"
        """), FAST)
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.status == "failed" and "connect -1" in result.stdout


@needs_nproc
def test_nproc_counts_only_the_sandbox():
    result = run_python(program("""
        import ctypes
        libc = ctypes.CDLL(None)
        n = 0
        for _ in range(32):
            pid = libc.fork()
            if pid == 0:
                libc.pause()
            if pid < 0:
                break
            n += 1
        print(n)
    """), FAST)
    assert result.passed and 0 < int(result.stdout) < Limits().max_processes


def test_hostile_humaneval_completions_count_as_failed():
    prompt, test = "def add(a, b):\n", "def check(f):\n    assert f(2, 3) == 5\n"
    limits = Limits(timeout_s=2.0)
    for completion in ("    while True:\n        pass\n",
                       "    import os\n    os.system('true')\n    return a + b\n",
                       "    import sys\n    sys.exit(0)\n",
                       "    return bytearray(8 << 30)\n"):
        assert metrics.humaneval_pass(prompt, completion, test, "add", limits) == 0.0, completion
    assert metrics.humaneval_pass(prompt, "    return a + b\n", test, "add", limits) == 1.0
