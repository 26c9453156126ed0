"""Bootstrap run as ``python -I _sandbox_child.py CONFIG`` inside the sandbox (see sandbox.py).

It is trusted code and imports only the standard library. In order, it:
  1. reads the JSON config (program text, work dir, limits, which layers to set up);
  2. with namespaces (started under ``unshare``): builds a private root, a read-only tmpfs holding
     read-only bind mounts of only what Python needs (the paths in the config plus the directories
     of the files this process has mapped: interpreter, shared libraries) and a size-limited tmpfs
     on the work dir, the only writable place; then pivots into it and detaches the old root, so
     nothing else of the host is reachable by any path;
  3. enters the work dir and sets rlimits (address space, CPU, file size, open files, core, processes);
  4. as root: becomes ``nobody`` (keeping only CAP_DAC_READ_SEARCH when the interpreter lives where
     ``nobody`` cannot read and Landlock confines that capability), sets no-new-privs and re-arms
     the parent-death signal;
  5. with Landlock: lets the program read only the same paths and write only the work dir (a
     kernel rule that holds for any user, whatever the file modes and capabilities);
  6. disables sockets and destructive ``os`` calls at the Python level (defence in depth only: the
     kernel layers above are what hold against code that goes around Python, e.g. via ctypes);
  7. runs the program as ``__main__`` (with namespaces, in a child of this process, which stays
     behind as the namespace's init to reap orphans and report how the program ended).

Exit codes: the program's own (0 = ran to its end), 3 = the program called ``exit()``, 97 = a
sandbox layer could not be set up (nothing of the program ran).
"""

import ctypes
import importlib
import json
import os
import platform
import resource
import signal
import stat
import sys
import traceback

SETUP_FAILED = 97
EXITED_EARLY = 3
NOBODY = 65534

# Linux constants (include/uapi/linux/{prctl,capability,mount,landlock}.h, fs/namespace.c).
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
CAP_DAC_READ_SEARCH, CAPABILITY_VERSION_3 = 2, 0x20080522
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 442, -100, 0x8000, 0x1, 0x2
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_MAKE_CHAR, LL_MAKE_BLOCK, LL_TRUNCATE = 1 << 7, 1 << 11, 1 << 14
LL_HANDLED_BITS = {1: 13, 2: 14, 3: 15, 4: 15}  # filesystem rights per Landlock ABI; 16 from ABI 5 on
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1 << 0, 1 << 1  # handled_access_net, from ABI 4
LL_SCOPE_ABSTRACT_UNIX_SOCKET, LL_SCOPE_SIGNAL = 1 << 0, 1 << 1  # scoped, from ABI 6

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


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _bytes(value: str | None) -> bytes | None:
    return value.encode() if value is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, opts: str | None = None) -> None:
    rc = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(opts))
    _check(rc, f"mount {target}")


def _mapped_dirs() -> set[str]:
    """Directories of the files mapped into this process: the interpreter, its shared libraries."""
    dirs: set[str] = set()
    if not os.path.exists("/proc/self/maps"):  # not Linux: no layer here uses them
        return dirs
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/"):
                dirs.add(os.path.dirname(fields[5].rstrip("\n").removesuffix(" (deleted)")))
    return {d for d in dirs if os.path.isdir(d)}


def _outermost(paths: set[str]) -> list[str]:
    """``paths`` without those inside another one (a recursive bind of the outer one holds them)."""
    kept: list[str] = []
    for path in sorted(paths):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _bind_read_only(path: str, new_root: str) -> None:
    target = new_root + path
    if os.path.isdir(path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(path, target, None, MS_BIND | MS_REC)


def _pivot_root(new_root: str) -> None:
    """Make ``new_root`` the root and detach the old one (pivot_root(".", "."), see pivot_root(2))."""
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(new_root)
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def _isolate_filesystem(cfg: dict, owner: int) -> None:
    """A private read-only root holding only the exposed paths, a fresh tmpfs on the work dir."""
    new_root, work = cfg["new_root"], cfg["workdir"]
    os.umask(0o022)  # the private root's own directories: 0755, so that `nobody` passes through
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=0755")
    for path in _outermost({*cfg["expose"], *_mapped_dirs()}):
        _bind_read_only(path, new_root)
    for link, target in cfg["links"]:
        if not os.path.lexists(new_root + link):
            os.makedirs(os.path.dirname(new_root + link), mode=0o755, exist_ok=True)
            os.symlink(target, new_root + link)
    os.makedirs(new_root + work, mode=0o755)
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    rc = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, new_root.encode(), AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr))
    _check(rc, "make the private root read-only")
    opts = f"size={cfg['disk_bytes']},mode=0700,uid={owner},gid={owner}"
    _mount("tmpfs", new_root + work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)
    _pivot_root(new_root)
    sys.path[:] = [p for p in sys.path if os.path.exists(p)]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def _landlock_rights(abi: int) -> int:
    return (1 << LL_HANDLED_BITS.get(abi, 16)) - 1


def _landlock_allow(ruleset: int, path: str, rights: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        rule = _PathBeneath(rights, fd)
        rc = _libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        _check(rc, f"landlock rule for {path}")
    finally:
        os.close(fd)


def _read_rights(path: str) -> int:
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        return LL_READ_FILE | LL_READ_DIR
    if stat.S_ISCHR(mode):  # /dev/null and the like: open("w") truncates
        return LL_READ_FILE | LL_WRITE_FILE | LL_TRUNCATE
    return LL_READ_FILE


def _restrict_with_landlock(readable: list[str], work: str) -> None:
    """From now on this process and its children may read ``readable`` and write only ``work``;
    no execve, no device nodes; where the kernel's Landlock has them (ABI 4 / 6), no TCP bind or
    connect, and no signals or abstract Unix sockets to processes outside the sandbox (without
    namespaces, the program would otherwise reach the network and could kill the evaluator, which runs
    as the same user). Needs no-new-privs (set by _harden_process)."""
    abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock is not available")
    handled = _landlock_rights(abi)
    # struct landlock_ruleset_attr { handled_access_fs; handled_access_net (ABI 4); scoped (ABI 6) }
    fields = [handled] + ([LL_NET_BIND_TCP | LL_NET_CONNECT_TCP] if abi >= 4 else [])
    fields += [LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL] if abi >= 6 else []
    attr = (ctypes.c_uint64 * len(fields))(*fields)  # no network rule: every TCP bind / connect is refused
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path in readable:
            if os.path.exists(path):
                _landlock_allow(ruleset, path, _read_rights(path) & handled)
        _landlock_allow(ruleset, work, handled & ~(LL_EXECUTE | LL_MAKE_CHAR | LL_MAKE_BLOCK))
        _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


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
        readable = [*cfg["expose"], *sorted(_mapped_dirs())]  # before the pivot: /proc is left behind
        if cfg["namespaces"]:
            _isolate_filesystem(cfg, NOBODY if root else 0)
            child = os.fork()
            if child:
                return _reap(child)
        os.chdir(cfg["workdir"])
        _set_limits(cfg)
        if root:
            _become_nobody(cfg["keep_read_search"])
        if sys.platform.startswith("linux"):
            _harden_process()
        if cfg["landlock"]:
            _restrict_with_landlock(readable, cfg["workdir"])
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
