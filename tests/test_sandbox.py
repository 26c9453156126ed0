"""The sandbox against hostile programs. Each hostile program is bounded on its own (at most 64
processes, loopback only, files under pytest's tmp dir or a unique /tmp name), so the host stays
safe even if a limit failed; the tests then check that the limit did hold.

Several programs go around the Python-level guards with ctypes (raw fork/unlink/socket calls), so
what is tested is the kernel-level layer: rlimits, namespaces, read-only mounts, uid nobody.

Reading the host is tested in each way the sandbox can block it: the private root alone, Landlock
alone, and the default (both where they work).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import sysconfig
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from dropmatch.tasks import metrics
from dropmatch.tasks.sandbox import (
    READ_GUARDS,
    Limits,
    _check_plan,
    _Plan,
    _Refused,
    _symlinks_on,
    isolation_layers,
    landlock_available,
    namespaces_available,
    run_python,
)

LAYERS = isolation_layers()
needs_namespaces = pytest.mark.skipif("namespaces" not in LAYERS, reason="unshare (network/PID/mount namespaces) "
                                      "does not work on this machine")
needs_nproc = pytest.mark.skipif("nobody" not in LAYERS, reason="RLIMIT_NPROC is only exact when root runs the "
                                 "program as nobody")
FAST = Limits(timeout_s=3.0)
CHECKOUT = Path(__file__).resolve().parents[1]
READ_MODES = {  # how the sandbox keeps the program from reading the host: run_python's arguments
    "private-root": {"namespaces": True, "landlock": False},
    "landlock": {"namespaces": False, "landlock": True},
    "default": {},
}


@pytest.fixture(params=list(READ_MODES))
def read_mode(request) -> dict:
    if request.param == "private-root" and not namespaces_available():
        pytest.skip("unshare (mount namespace, pivot_root) does not work on this machine")
    if request.param == "landlock" and not landlock_available():
        pytest.skip("this kernel has no Landlock")
    if request.param == "default" and not any(layer in LAYERS for layer in READ_GUARDS):
        pytest.skip("no layer that blocks reads works here (see test_without_a_read_guard_the_sandbox_refuses)")
    return READ_MODES[request.param]


@pytest.fixture
def home_secret():
    """A world-readable file in the home directory, as an SSH key or a token would sit there."""
    path = Path.home() / f".dropmatch-sandbox-secret-{uuid.uuid4().hex}"
    path.write_text("home-secret-value\n")
    path.chmod(0o644)
    yield path
    path.unlink()


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


def _raw_connect(**where):
    """Run a program that connects to a local TCP server with raw libc calls (around the Python guard)
    and fails unless it gets through; check that the server got no connection. The result."""
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
        """), FAST, **where)
        with pytest.raises(socket.timeout):
            server.accept()
    return result


@needs_namespaces
def test_no_network_even_around_python():
    result = _raw_connect()
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


# --- reading the host ------------------------------------------------------------------------

def _try_reads(files: list[str], dirs: list[str], mode: dict) -> dict:
    """Outcome of opening each file and listing each dir inside the sandbox: the text or listing, or
    ``"refused: <error>"``."""
    result = run_python(program(f"""
        import json, os
        out = {{}}
        for path in {files!r}:
            try:
                with open(path) as f:
                    out[path] = f.read(200)
            except OSError as exc:
                out[path] = "refused: " + type(exc).__name__
        for path in {dirs!r}:
            try:
                out[path] = sorted(os.listdir(path))
            except OSError as exc:
                out[path] = "refused: " + type(exc).__name__
        print(json.dumps(out))
    """), FAST, **mode)
    assert result.passed, result.stderr
    assert result.host_reads_blocked and any(g in result.isolation for g in READ_GUARDS)
    return json.loads(result.stdout)


def _hidden_entries(directory: Path) -> set[str]:
    """Real entries of ``directory`` that no path the sandbox needs (interpreter, system libraries,
    devices, its temporary directory) goes through: none of them may show inside."""
    needed = [Path(p).resolve() for p in (sys.base_prefix, sys.base_exec_prefix, tempfile.gettempdir())]
    needed += [Path(p) for p in ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/etc", "/dev")]
    return {name for name in os.listdir(directory)
            if not any(n == directory / name or directory / name in n.parents for n in needed)}


def test_host_files_cannot_be_read(read_mode, home_secret, tmp_path):
    outside = tmp_path / "outside.txt"  # a world-readable file outside the work dir, in /tmp
    outside.write_text("tmp-secret-value\n")
    outside.chmod(0o644)
    files = [str(home_secret), str(CHECKOUT / "README.md"), "/etc/passwd", "/etc/shadow", str(outside)]
    files = [f for f in files if os.path.exists(f)]
    assert str(home_secret) in files and str(CHECKOUT / "README.md") in files
    outcome = _try_reads(files, [], read_mode)
    assert all(str(outcome[f]).startswith("refused") for f in files), outcome
    assert "secret-value" not in json.dumps(outcome)


def test_host_directories_cannot_be_listed(read_mode, home_secret):
    dirs = [Path("/"), Path.home().resolve(), CHECKOUT.parent, CHECKOUT]
    outcome = _try_reads([], [str(d) for d in dirs], read_mode)
    for d in dirs:
        hidden = _hidden_entries(d)
        assert hidden, f"{d} has no entry the sandbox should hide"  # e.g. the secret, the checkout
        seen = outcome[str(d)]
        assert isinstance(seen, str) and seen.startswith("refused") or not hidden & set(seen), (d, seen)
    assert home_secret.name in _hidden_entries(Path.home().resolve())


def test_a_file_handle_does_not_reach_the_host(read_mode, home_secret):
    """With CAP_DAC_READ_SEARCH, open_by_handle_at opens any file of a mounted file system, whatever
    the mount namespace shows: the capability must be gone, or Landlock must still refuse."""
    stdlib = sysconfig.get_path("stdlib")
    if os.stat(stdlib).st_dev != os.stat(home_secret).st_dev:
        pytest.skip("the home directory and the interpreter are on different file systems")
    libc = ctypes.CDLL(None, use_errno=True)
    handle = ctypes.create_string_buffer(8 + 128)  # struct file_handle with MAX_HANDLE_SZ bytes
    ctypes.c_uint32.from_buffer(handle).value = 128
    mount_id = ctypes.c_int()
    if libc.name_to_handle_at(-100, str(home_secret).encode(), handle, ctypes.byref(mount_id), 0) != 0:
        pytest.skip("this file system gives no file handles")
    result = run_python(program(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        handle = ctypes.create_string_buffer(bytes.fromhex({bytes(handle).hex()!r}))
        fd = libc.open_by_handle_at(os.open({stdlib!r}, os.O_RDONLY), handle, os.O_RDONLY)
        print("fd", fd, os.read(fd, 100) if fd >= 0 else ctypes.get_errno())
    """), FAST, **read_mode)
    assert result.passed, result.stderr
    assert "fd -1" in result.stdout and "secret" not in result.stdout


def test_humaneval_style_program_still_passes(read_mode):
    prompt = program("""
        import collections, fractions, functools, hashlib, heapq, itertools, math, os, random, re, string
        from decimal import Decimal
        from typing import List


        def most_common_words(text: str, k: int) -> List[str]:
    """)
    completion = "    words = re.findall(r'[a-z]+', text.lower())\n" \
                 "    return [w for w, _ in collections.Counter(words).most_common(k)]\n"
    test = program("""
        def check(candidate):
            assert candidate("a b a c a b", 2) == ["a", "b"]
            assert list(itertools.accumulate([1, 2, 3])) == [1, 3, 6] and math.comb(5, 2) == 10
            assert heapq.nsmallest(2, [5, 1, 4]) == [1, 4] and functools.reduce(max, [3, 9, 2]) == 9
            assert fractions.Fraction(1, 3) * 3 == 1 and Decimal("0.1") * 3 == Decimal("0.3")
            assert hashlib.sha256(b"x").hexdigest().startswith("2d711642") and string.digits == "0123456789"
            assert len(os.urandom(8)) == 8 and 0 <= random.random() < 1
            with open(os.devnull, "w") as f:
                f.write("ignored")
            with open("scratch.txt", "w") as f:
                f.write("the work dir is writable")
            assert open("scratch.txt").read().startswith("the work dir")
    """)
    result = run_python(metrics.humaneval_program(prompt, completion, test, "most_common_words"), FAST,
                        **read_mode)
    assert result.passed, result.stderr
    assert result.host_reads_blocked


def test_without_a_read_guard_the_sandbox_refuses():
    refused = run_python("print('ran')\n", FAST, namespaces=False, landlock=False)
    assert refused.status == "error" and refused.returncode is None and "ran" not in refused.stdout
    assert "allow_host_reads" in refused.stderr and not refused.host_reads_blocked
    weaker = run_python("print('ran')\n", FAST, namespaces=False, landlock=False, allow_host_reads=True)
    assert weaker.passed and weaker.stdout == "ran\n"
    assert not weaker.host_reads_blocked and not set(READ_GUARDS) & set(weaker.isolation)
    with pytest.raises(_Refused, match="CAP_DAC_READ_SEARCH"):  # the capability unconfined: refused too
        _check_plan(_Plan(namespaces=True, landlock=False), keep_read_search=True)
    _check_plan(_Plan(namespaces=True, landlock=True), keep_read_search=True)


def test_symlinks_on_the_way_to_an_exposed_path_are_recreated(tmp_path):
    (tmp_path / "real" / "lib").mkdir(parents=True)
    (tmp_path / "usr").symlink_to("real")
    (tmp_path / "real" / "lib" / "py").symlink_to(tmp_path / "real" / "lib")
    links = _symlinks_on(str(tmp_path / "usr" / "lib" / "py"))
    assert links == [(str(tmp_path / "usr"), "real"), (str(tmp_path / "real" / "lib" / "py"),
                                                         str(tmp_path / "real" / "lib"))]
    assert _symlinks_on(str(tmp_path / "real" / "lib")) == []


def _landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return max(0, libc.syscall(444, None, 0, 1))  # landlock_create_ruleset(NULL, 0, VERSION)


@pytest.mark.skipif(not landlock_available() or _landlock_abi() < 4, reason="needs Landlock ABI >= 4 (TCP rules)")
def test_landlock_alone_keeps_the_program_off_tcp():
    """Without namespaces (a non-root user's sandbox) the network namespace is gone; Landlock refuses
    TCP connect itself (before: the program reached a local server through raw ctypes calls)."""
    result = _raw_connect(namespaces=False, landlock=True)
    assert result.status == "failed" and "connect -1" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(not landlock_available() or _landlock_abi() < 6, reason="needs Landlock ABI >= 6 (signal scoping)")
def test_landlock_alone_keeps_the_program_from_signalling_processes_outside():
    """A process outside the sandbox running as the program's own user (as the evaluator does for a
    non-root user) cannot be signalled: signal 0, the existence probe, is refused with EPERM."""
    import pwd
    import subprocess

    user = {"user": "nobody"} if os.getuid() == 0 else {}  # as root the program runs as nobody
    outsider = subprocess.Popen(["sleep", "60"], **user)
    try:
        result = run_python(program(f"""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            print("kill", libc.kill({outsider.pid}, 0), ctypes.get_errno())
        """), FAST, namespaces=False, landlock=True)
        assert outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()
    assert pwd.getpwnam("nobody") and result.passed and "kill -1 1" in result.stdout, result.stdout + result.stderr


def test_an_output_cap_of_zero_keeps_nothing():
    result = run_python("print('x' * 1000)\n", Limits(timeout_s=3.0, max_output_bytes=0))
    assert result.passed and result.stdout == ""


def test_humaneval_is_not_scored_where_the_sandbox_refuses(monkeypatch):
    from dropmatch.errors import SandboxError
    from dropmatch.tasks import sandbox

    monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    monkeypatch.setattr(sandbox, "landlock_available", lambda: False)
    with pytest.raises(SandboxError, match="sandbox refused"):
        metrics.humaneval_pass("def f():\n", "    return 1\n", "def check(f):\n    assert f() == 1\n", "f", FAST)
