"""Bootstrap run as ``python -I _sandbox_child.py CONFIG`` inside the sandbox (see sandbox.py).

It is trusted code and imports only the standard library. In order, it:
  1. reads the JSON config (program text, work dir, limits, which layers to set up);
  2. with namespaces (started under ``unshare``): remounts the whole tree read-only and mounts a
     size-limited tmpfs on the work dir, the only writable place;
  3. enters the work dir and sets rlimits (address space, CPU, file size, open files, core, processes);
  4. as root: becomes ``nobody`` (keeping only CAP_DAC_READ_SEARCH when the interpreter lives where
     ``nobody`` cannot read, e.g. under /root), sets no-new-privs and re-arms the parent-death signal;
  5. disables sockets and destructive ``os`` calls at the Python level (defence in depth only: the
     kernel layers above are what hold against code that goes around Python, e.g. via ctypes);
  6. runs the program as ``__main__`` (with namespaces, in a child of this process, which stays
     behind as the namespace's init to reap orphans and report how the program ended).

Exit codes: the program's own (0 = ran to its end), 3 = the program called ``exit()``, 97 = a
sandbox layer could not be set up (nothing of the program ran).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

SETUP_FAILED = 97
EXITED_EARLY = 3
NOBODY = 65534

# Linux constants (include/uapi/linux/{prctl,capability,mount}.h, fs/namespace.c).
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
CAP_DAC_READ_SEARCH, CAPABILITY_VERSION_3 = 2, 0x20080522
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def _isolate_filesystem(work: str, size: int, owner: int) -> None:
    """Everything read-only in this mount namespace, then a fresh tmpfs on ``work``."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    rc = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(rc, "remount / read-only")
    opts = f"size={size},mode=0700,uid={owner},gid={owner}".encode()
    _check(_libc.mount(b"tmpfs", work.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts), "mount tmpfs")


def _set_limits(cfg: dict) -> None:
    cpu = int(cfg["cpu_s"])
    limits = {
        resource.RLIMIT_AS: cfg["memory_bytes"],
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_FSIZE: cfg["max_file_bytes"],
        resource.RLIMIT_NOFILE: 256,
        resource.RLIMIT_CORE: 0,
    }
    if cfg["nproc"] is not None:
        limits[resource.RLIMIT_NPROC] = cfg["nproc"]
    for which, value in limits.items():
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))


def _become_nobody(keep_read_search: bool) -> None:
    _check(_libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "keep caps")
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    data = (_CapData * 2)()
    if keep_read_search:
        data[0].effective = data[0].permitted = 1 << CAP_DAC_READ_SEARCH
    _check(_libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), data), "capset")
    _check(_libc.prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0), "drop keep caps")


def _harden_process() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privs")
    # The parent-death signal is cleared by a change of uid: arm it (again) last.
    _check(_libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0), "parent death signal")


def _reap(child: int) -> int:
    """As init of the PID namespace: reap every orphan until ``child`` ends; report how it ended.

    The program must not run as init: init ignores signals it has no handler for, SIGXCPU and
    SIGXFSZ from its rlimits included. A death by signal N is reported as exit code 128 + N."""
    while True:
        pid, status = os.wait()
        if pid == child:
            return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the sandbox")

    return refused


def _python_guards() -> None:
    """Make the obvious Python calls fail loudly. Not a security boundary on its own."""
    import _socket
    import shutil
    import socket
    import subprocess

    class NoSocket:
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the sandbox")

    socket.socket = _socket.socket = NoSocket
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, _refuse(f"socket.{name}"))
    for name in ("fork", "forkpty", "kill", "killpg", "system", "popen", "execv", "execve", "execvp",
                 "execvpe", "spawnv", "spawnve", "posix_spawn", "posix_spawnp", "remove", "unlink",
                 "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod", "chown",
                 "lchown", "fchmod", "fchown", "setuid", "setgid", "putenv", "unsetenv"):
        if hasattr(os, name):
            setattr(os, name, _refuse(f"os.{name}"))
    shutil.rmtree = _refuse("shutil.rmtree")
    shutil.move = _refuse("shutil.move")
    subprocess.Popen = _refuse("subprocess.Popen")


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        cfg = json.load(f)
    program = compile(cfg["code"], "<program>", "exec")
    try:
        root = os.geteuid() == 0
        if cfg["namespaces"]:
            _isolate_filesystem(cfg["workdir"], cfg["disk_bytes"], NOBODY if root else 0)
            child = os.fork()
            if child:
                return _reap(child)
        os.chdir(cfg["workdir"])
        _set_limits(cfg)
        if root:
            _become_nobody(cfg["keep_read_search"])
        if sys.platform.startswith("linux"):
            _harden_process()
        _python_guards()
    except Exception as exc:  # fail closed: run nothing if a layer is missing
        print(f"sandbox setup failed: {exc!r}", file=sys.stderr, flush=True)
        return SETUP_FAILED
    sys.argv = ["<program>"]
    try:
        exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        print("the program called exit() before it ended", file=sys.stderr, flush=True)
        return EXITED_EARLY
    except BaseException as exc:  # the traceback from the program's own frames on
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
