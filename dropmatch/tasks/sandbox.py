"""Run untrusted Python (e.g. HumanEval completions) in a separate, limited process.

``run_python(code)`` never executes ``code`` in this process. It starts ``python -I`` on the trusted
bootstrap ``_sandbox_child.py`` and gives back a ``SandboxResult``. Layers, outermost first:

* always: a new session (own process group); scrubbed environment (PATH, HOME/TMPDIR = the work
  dir, C.UTF-8 locale); stdin from /dev/null; no inherited file descriptors; a fresh temporary
  directory, removed afterwards; stdout/stderr read through pipes, only the last
  ``max_output_bytes`` of each kept; a wall-clock timeout after which the process group, and any
  process still carrying this run's id on its command line, is killed with SIGKILL (also done when
  the program ends, so nothing it started survives it);
* rlimits: address space (``memory_bytes``), CPU seconds, size of a written file, open files, no
  core dumps, and the number of processes (RLIMIT_NPROC, counted per uid: effective because root
  runs the code as ``nobody``; for a non-root user it is set to that user's current count plus
  ``max_processes``, best effort);
* namespaces, when ``unshare`` works here (root or CAP_SYS_ADMIN on Linux): new network namespace
  (no interface is up, not even loopback: connecting anywhere fails), PID namespace (everything
  dies with its init), mount namespace with the whole tree read-only and a size-limited tmpfs
  (``disk_bytes``) as the work dir, IPC and UTS namespaces;
* as root: uid/gid ``nobody`` with no capabilities (except CAP_DAC_READ_SEARCH when the
  interpreter lives where ``nobody`` cannot read, e.g. a pyenv under /root), no-new-privs, and
  SIGKILL on parent death;
* Python level, defence in depth only: sockets and destructive ``os``/``shutil``/``subprocess``
  calls raise PermissionError.

The statuses: ``passed`` (the program ran to its end), ``failed`` (exception, non-zero exit,
``exit()`` called, killed by a limit), ``timeout`` (wall clock or CPU limit), ``error`` (the sandbox
itself could not start or set up a layer; nothing of the program ran).

What it cannot stop: reading files readable to the child (no secrets should sit on a machine that
evaluates untrusted code), and a program that fakes success with ``os._exit(0)``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("_sandbox_child.py")
SETUP_FAILED = 97  # must match _sandbox_child.py
NOBODY = 65534
UNSHARE_ARGS = ("--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run. ``cpu_s`` defaults to the timeout rounded up, plus one second."""

    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    cpu_s: int | None = None
    max_processes: int = 8
    max_file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    max_output_bytes: int = 16 << 10


@dataclass(frozen=True)
class SandboxResult:
    status: str  # passed | failed | timeout | error
    returncode: int | None
    stdout: str  # the last max_output_bytes
    stderr: str
    duration_s: float
    isolation: tuple[str, ...]  # the layers that were on
    run_id: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_python(code: str, limits: Limits | None = None, *, namespaces: bool | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox. ``namespaces=None`` uses them where they work."""
    limits = limits or Limits()
    use_ns = namespaces_available() if namespaces is None else namespaces
    return _run(code, limits, use_ns)


@functools.cache
def namespaces_available() -> bool:
    """Whether the namespace layer works on this machine (probed once per process)."""
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return False
    return _run("pass", Limits(timeout_s=15.0), use_ns=True).passed


def isolation_layers() -> tuple[str, ...]:
    """The layers ``run_python`` turns on here."""
    return _layers(namespaces_available())


def _layers(use_ns: bool) -> tuple[str, ...]:
    layers = ["subprocess", "rlimits"]
    if use_ns:
        layers.append("namespaces")
    if os.geteuid() == 0:
        layers.append("nobody")
    return (*layers, "python-guards")


def _run(code: str, limits: Limits, use_ns: bool) -> SandboxResult:
    run_id = f"dropmatch-sandbox-{uuid.uuid4().hex}"
    tmp = Path(tempfile.mkdtemp(prefix=run_id + "-"))
    start = time.monotonic()
    try:
        cmd = _prepare(tmp, code, limits, use_ns)
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=tmp, env=_clean_env(tmp / "work"), start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            return SandboxResult("error", None, "", f"could not start the sandbox: {exc}",
                                 time.monotonic() - start, _layers(use_ns), run_id)
        try:
            out, err, timed_out = _collect(proc, start + limits.timeout_s, limits.max_output_bytes)
        finally:
            _kill_all(proc, str(tmp))
        return SandboxResult(
            _status(proc.returncode, timed_out), proc.returncode,
            out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
            time.monotonic() - start, _layers(use_ns), run_id,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare(tmp: Path, code: str, limits: Limits, use_ns: bool) -> list[str]:
    """Write the config and the work dir; return the command line."""
    root = os.geteuid() == 0
    os.chmod(tmp, 0o711)  # `nobody` may pass through to work/, not list or read the rest
    work = tmp / "work"
    work.mkdir(mode=0o700)
    if root and not use_ns:
        os.chown(work, NOBODY, NOBODY)
    cfg = {
        "code": code,
        "workdir": str(work),
        "namespaces": use_ns,
        "memory_bytes": limits.memory_bytes,
        "cpu_s": limits.cpu_s or math.ceil(limits.timeout_s) + 1,
        "max_file_bytes": limits.max_file_bytes,
        "disk_bytes": limits.disk_bytes,
        "nproc": limits.max_processes if root else _tasks_of_uid(os.getuid()) + limits.max_processes,
        "keep_read_search": root and not _interpreter_readable_by_others(),
    }
    cfg_path = tmp / "config.json"
    fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    cmd = [sys.executable, "-I", str(CHILD), str(cfg_path)]
    return [shutil.which("unshare") or "unshare", *UNSHARE_ARGS, *cmd] if use_ns else cmd


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """Read stdout/stderr (keeping the last ``cap`` bytes of each) until the process exits or the
    deadline passes. Processes it left behind may hold the pipes open: stop 0.2 s after it exits."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    exited_at = None
    timed_out = False
    while True:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if proc.poll() is not None:
            exited_at = exited_at or now
            if not sel.get_map() or now - exited_at > 0.2:
                break
        elif not sel.get_map():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(0.05, deadline - now))
            continue
        for key, _ in sel.select(timeout=min(0.05, max(deadline - now, 0.0))):
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fd]
            buf += chunk
            del buf[:-cap]
    sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out


def _kill_all(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL the process group and every process whose command line names this run."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(5):
        pids = _pids_mentioning(marker)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    with contextlib.suppress(subprocess.TimeoutExpired):  # never hang the caller on an unkillable child
        proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def _pids_mentioning(marker: str) -> list[int]:
    needle, me, found = marker.encode(), os.getpid(), []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _tasks_of_uid(uid: int) -> int:
    """Threads owned by ``uid`` (what RLIMIT_NPROC counts); 0 where /proc is missing."""
    count = 0
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


@functools.cache
def _interpreter_readable_by_others() -> bool:
    """Whether `nobody` can reach the interpreter's prefix and every directory on sys.path."""
    dirs = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *sys.path) if p and os.path.isdir(p)}
    for d in dirs:
        for part in (d, *d.parents):
            mode = part.stat().st_mode
            if not mode & stat.S_IXOTH or (part == d and not mode & stat.S_IROTH):
                return False
    return True


def _clean_env(work: Path) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }


def _status(returncode: int | None, timed_out: bool) -> str:
    # A death by signal N: -N from Popen, or 128 + N as reported by the namespace's init.
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
    if returncode == 0:
        return "passed"
    return "error" if returncode == SETUP_FAILED else "failed"
