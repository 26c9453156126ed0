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
  dies with its init), IPC and UTS namespaces, and a mount namespace whose root is private
  ("private-root"): a read-only tmpfs holding read-only bind mounts of only what Python needs (the
  real paths of the interpreter's prefix and standard library, the directories of the shared
  libraries it has loaded, /usr/lib, /lib*, /etc/ld.so.cache, /dev/null, /dev/zero, /dev/random,
  /dev/urandom) and a size-limited tmpfs (``disk_bytes``) as the work dir; the old root is
  detached, so the rest of the host (home directories, the project, /etc, /proc) does not exist;
* Landlock, where the kernel has it (any user, with or without namespaces): the program may read
  only those same paths and write only its work dir, whatever the file modes or its capabilities;
* as root: uid/gid ``nobody`` with no capabilities (except CAP_DAC_READ_SEARCH when the
  interpreter's files are not readable by ``nobody`` and Landlock confines what the capability
  reaches), no-new-privs, and SIGKILL on parent death;
* Python level, defence in depth only: sockets and destructive ``os``/``shutil``/``subprocess``
  calls raise PermissionError.

The statuses: ``passed`` (the program ran to its end), ``failed`` (exception, non-zero exit,
``exit()`` called, killed by a limit), ``timeout`` (wall clock or CPU limit), ``error`` (the sandbox
itself could not start or set up a layer; nothing of the program ran).

Reading the host is refused unless one of "private-root" and "landlock" is on: where neither works
(no ``unshare``, no Landlock: e.g. macOS, or an old kernel for a non-root user), ``run_python``
returns ``error`` and runs nothing, unless the caller passes ``allow_host_reads=True``; the result's
``isolation`` then lacks both (``SandboxResult.host_reads_blocked`` is False).

What it cannot stop: a program reading the files that are exposed (the Python installation and the
system libraries; no secrets should live there), learning that a path exists under Landlock alone
(stat is not restricted, opening and listing are), and a program that fakes success with
``os._exit(0)``.
"""

from __future__ import annotations

import contextlib
import ctypes
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
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("_sandbox_child.py")
SETUP_FAILED = 97  # must match _sandbox_child.py
NOBODY = 65534
UNSHARE_ARGS = ("--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts")
SYSTEM_PATHS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32",
                "/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
READ_GUARDS = ("private-root", "landlock")
SYS_LANDLOCK_CREATE_RULESET, LANDLOCK_CREATE_RULESET_VERSION = 444, 1


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

    @property
    def host_reads_blocked(self) -> bool:
        """Whether a layer kept the program from reading the host's files."""
        return any(layer in self.isolation for layer in READ_GUARDS)


@dataclass(frozen=True)
class _Plan:
    namespaces: bool
    landlock: bool
    allow_host_reads: bool = False


class _Refused(Exception):
    """The sandbox will not run the program: a required layer is missing."""


def run_python(code: str, limits: Limits | None = None, *, namespaces: bool | None = None,
               landlock: bool | None = None, allow_host_reads: bool = False) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox. ``namespaces``/``landlock`` = None: use them where
    they work. Without either, status ``error`` unless ``allow_host_reads``: then the program reads
    whatever its user can (as root with a pyenv under /root: any file, through CAP_DAC_READ_SEARCH)."""
    limits = limits or Limits()
    use_ns = namespaces_available() if namespaces is None else namespaces
    use_ll = landlock_available() if landlock is None else landlock
    return _run(code, limits, _Plan(use_ns, use_ll, allow_host_reads))


@functools.cache
def namespaces_available() -> bool:
    """Whether the namespace layer, private root included, works here (probed once per process)."""
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return False
    return _run("pass", Limits(timeout_s=15.0), _Plan(True, landlock_available())).passed


@functools.cache
def landlock_available() -> bool:
    """Whether Landlock can confine the program here (probed once per process)."""
    if _landlock_abi() < 1:
        return False
    return _run("pass", Limits(timeout_s=15.0), _Plan(False, True)).passed


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return max(int(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)), 0)


def isolation_layers() -> tuple[str, ...]:
    """The layers ``run_python`` turns on here."""
    return _layers(_Plan(namespaces_available(), landlock_available()))


def _layers(plan: _Plan) -> tuple[str, ...]:
    layers = ["subprocess", "rlimits"]
    if plan.namespaces:
        layers += ["namespaces", "private-root"]
    if os.geteuid() == 0:
        layers.append("nobody")
    if plan.landlock:
        layers.append("landlock")
    return (*layers, "python-guards")


def _run(code: str, limits: Limits, plan: _Plan) -> SandboxResult:
    run_id = f"dropmatch-sandbox-{uuid.uuid4().hex}"
    tmp = Path(tempfile.mkdtemp(prefix=run_id + "-"))
    start = time.monotonic()

    def error(message: str) -> SandboxResult:
        return SandboxResult("error", None, "", message, time.monotonic() - start, _layers(plan), run_id)

    try:
        try:
            cmd = _prepare(tmp, code, limits, plan)
        except _Refused as exc:
            return error(str(exc))
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=tmp, env=_clean_env(tmp / "work"), start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            return error(f"could not start the sandbox: {exc}")
        try:
            out, err, timed_out = _collect(proc, start + limits.timeout_s, limits.max_output_bytes)
        finally:
            _kill_all(proc, str(tmp))
        return SandboxResult(
            _status(proc.returncode, timed_out), proc.returncode,
            out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
            time.monotonic() - start, _layers(plan), run_id,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare(tmp: Path, code: str, limits: Limits, plan: _Plan) -> list[str]:
    """Write the config and the work dir; return the command line. Raises _Refused."""
    root = os.geteuid() == 0
    keep_read_search = root and not _stdlib_readable_by_others(plan.namespaces)
    _check_plan(plan, keep_read_search)
    os.chmod(tmp, 0o711)  # `nobody` may pass through to work/, not list or read the rest
    work = tmp / "work"
    work.mkdir(mode=0o700)
    (tmp / "root").mkdir(mode=0o700)
    if root and not plan.namespaces:
        os.chown(work, NOBODY, NOBODY)
    expose, links = _exposed()
    cfg = {
        "code": code,
        "workdir": str(work),
        "namespaces": plan.namespaces,
        "new_root": str(tmp / "root"),
        "expose": list(expose),
        "links": [list(link) for link in links],
        "landlock": plan.landlock,
        "memory_bytes": limits.memory_bytes,
        "cpu_s": limits.cpu_s or math.ceil(limits.timeout_s) + 1,
        "max_file_bytes": limits.max_file_bytes,
        "disk_bytes": limits.disk_bytes,
        "nproc": limits.max_processes if root else _tasks_of_uid(os.getuid()) + limits.max_processes,
        "keep_read_search": keep_read_search,
    }
    cfg_path = tmp / "config.json"
    fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    cmd = [sys.executable, "-I", str(CHILD), str(cfg_path)]
    return [shutil.which("unshare") or "unshare", *UNSHARE_ARGS, *cmd] if plan.namespaces else cmd


def _check_plan(plan: _Plan, keep_read_search: bool) -> None:
    """Refuse a run that would let the program read the host without the caller's consent."""
    if plan.allow_host_reads:
        return
    if not (plan.namespaces or plan.landlock):
        raise _Refused(
            "sandbox refused: nothing here keeps the program from reading the host's files (the "
            "namespace layer needs unshare as root on Linux, Landlock a Linux kernel with it enabled); "
            "pass allow_host_reads=True to run with that weaker isolation")
    if keep_read_search and not plan.landlock:
        raise _Refused(
            f"sandbox refused: the interpreter under {sys.base_prefix} is not readable by `nobody`, and "
            "keeping CAP_DAC_READ_SEARCH without Landlock would let the program open any file by handle; "
            "make it world-readable or pass allow_host_reads=True")


@functools.cache
def _exposed() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The real paths the program may read, and the symlinks on the way to them (link, target)."""
    paths, links = set(), []
    for path in (sys.base_prefix, sys.base_exec_prefix, *_stdlib_dirs(), *SYSTEM_PATHS):
        if path and os.path.exists(path):
            paths.add(os.path.realpath(path))
            links += _symlinks_on(path)
    home = Path.home().resolve()
    for path in paths:
        if path == "/" or home == Path(path) or Path(path) in home.parents:
            raise _Refused(f"sandbox refused: it would expose {path}, which holds the home directory {home}")
    return tuple(sorted(paths)), tuple(dict.fromkeys(links))


def _stdlib_dirs() -> list[str]:
    """The standard library's directories as ``sys.path`` names them."""
    dirs = [sysconfig.get_path("stdlib"), sysconfig.get_config_var("DESTSHARED")]  # not a venv's dirs
    bases = tuple(os.path.realpath(b) + os.sep for b in (sys.base_prefix, sys.base_exec_prefix))
    dirs += [p for p in sys.path if p and os.path.realpath(p).startswith(bases)]
    return [d for d in dirs if d]


def _symlinks_on(path: str, depth: int = 0) -> list[tuple[str, str]]:
    """The symlinks met while resolving ``path``, outermost first, as (link, its target)."""
    p = Path(os.path.abspath(path))
    for part in (*reversed(p.parents[:-1]), p):
        if depth < 40 and part.is_symlink():
            target = os.readlink(part)
            resolved = os.path.normpath(part.parent / target / p.relative_to(part))
            return [(str(part), target), *_symlinks_on(resolved, depth + 1)]
    return []


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
            del buf[: max(len(buf) - cap, 0)]  # the last ``cap`` bytes (none for cap 0; buf[:-0] is empty)
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
def _stdlib_readable_by_others(private_root: bool) -> bool:
    """Whether `nobody` can reach and read the standard library's directories. In a private root
    the directories above an exposed path are the sandbox's own (0755): only the exposed part counts."""
    exposed = [Path(p) for p in _exposed()[0]] if private_root else []
    for d in {Path(p).resolve() for p in _stdlib_dirs() if os.path.isdir(p)}:
        top = max((e for e in exposed if e == d or e in d.parents), key=lambda e: len(e.parts), default=Path("/"))
        for part in (d, *d.parents):
            mode = part.stat().st_mode
            if not mode & stat.S_IXOTH or (part == d and not mode & stat.S_IROTH):
                return False
            if part == top:
                break
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
