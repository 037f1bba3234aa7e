"""The first process inside a code sandbox: confines itself, then runs the untrusted `main.py` in-process.

Not imported by arbor: `sandbox.py` passes this file's source to `python -I -B -c` (so the child needs no read
access to the repository) with a JSON configuration as argv[1]. It uses only the standard library. Steps, in an
order that matters: join the cgroups (while /sys is still writable); mount a size-bounded tmpfs on the work
directory and make every other mount read-only (mount namespace); set rlimits; empty the capability bounding
set, then drop to the sandbox uid/gid (so RLIMIT_NPROC is enforced and nothing of root's is writable) and drop
every capability; forbid regaining any (no_new_privs); die with the parent (PR_SET_PDEATHSIG, last, since a
credential change clears it); install the best-effort audit hook when asked (the mode without namespaces); and
only then run the user's code. Any setup failure exits 125 before user code runs.
"""

import ctypes
import json
import os
import resource
import runpy
import sys

SETUP_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND = 1024, 2048, 4096
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
KEEP_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_PDEATHSIG = 38, 24, 1


def fail(msg):
    os.write(2, f"sandbox setup failed: {msg}\n".encode())
    os._exit(SETUP_FAILED)


def mount(libc, src, target, flags, fstype=None, data=None):
    if libc.mount(src, target.encode(), fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def unescape(path):
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
    return path.encode().decode("unicode_escape").encode("latin-1").decode()


def read_only_everything_but(workdir, size_mb, uid, gid):
    """Mount a tmpfs of `size_mb` on the work directory (which bounds the disk a run can fill; the few files
    already there are copied in), then remount every other mount read-only.

    Flags a remount does not name are cleared, so the existing nosuid/nodev/noexec/atime flags are repeated
    (in a user namespace they are locked and changing them fails)."""
    libc = ctypes.CDLL(None, use_errno=True)
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    owner = f",uid={uid},gid={gid}" if uid is not None else ""
    mount(libc, b"tmpfs", workdir, MS_NOSUID | MS_NODEV, b"tmpfs", f"size={size_mb}m,mode=700{owner}".encode())
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        if uid is not None:
            os.chown(path, uid, gid)
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in reversed(lines):  # children before parents, as listed last
        fields = line.split()
        target, opts = unescape(fields[4]), fields[5].split(",")
        if target == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in opts:
            flags |= KEEP_FLAGS.get(opt, 0)
        try:
            mount(libc, None, target, flags)
        except OSError as e:
            if e.errno != 2:  # a mount point hidden by a later mount cannot be reached and needs nothing
                raise


def audit_hook(workdir):
    """Best effort when there are no namespaces: refuse sockets, process creation, native code loading and
    writes outside the work directory. Python code cannot remove an audit hook, but native code could bypass it,
    hence `ctypes` is refused too."""
    root = os.path.realpath(workdir) + os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    path_events = {
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.symlink",
        "os.link",
        "os.truncate",
        "os.utime",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
    }
    refused_prefixes = (
        "socket.",
        "subprocess.",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "os.fork",
        "os.forkpty",
        "ctypes.",
        "_posixsubprocess.",
        "os.kill",
        "os.killpg",
    )
    realpath = os.path.realpath

    def outside(path):
        if isinstance(path, int):
            return False
        try:
            p = realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return True
        return not (p + os.sep).startswith(root)

    def hook(event, args):
        if event.startswith(refused_prefixes) and event != "socket.gethostname":
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[0] is not None:
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & write_flags)
            if writing and outside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the work directory")
        elif event in path_events and any(outside(a) for a in args if isinstance(a, (str, bytes, os.PathLike))):
            raise PermissionError(f"sandbox: {event} outside the work directory")

    sys.addaudithook(hook)


def drop_bounding_set(libc):
    """Empties the capability bounding set (needs CAP_SETPCAP, so before the uid drop)."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


def drop_capabilities(libc):
    """Empties the effective, permitted and inheritable sets. Needed when the run stays uid 0 inside a user
    namespace: that root owns the mount namespace and could otherwise remount it writable."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def main():
    cfg = json.loads(sys.argv[1])
    workdir = cfg["workdir"]
    try:
        for procs in cfg.get("cgroup_procs") or []:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        if cfg.get("read_only_mounts"):
            read_only_everything_but(workdir, cfg["disk_mb"], cfg.get("uid"), cfg.get("gid"))
        for name, value in cfg["rlimits"].items():
            soft, hard = value if isinstance(value, list) else (value, value)
            resource.setrlimit(getattr(resource, name), (soft, hard))
        libc = ctypes.CDLL(None, use_errno=True)
        drop_bounding_set(libc)
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        drop_capabilities(libc)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        # Die with the parent (the orchestrator, or unshare). Set last: a credential change clears it.
        if libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        os.chdir(workdir)
    except OSError as e:
        fail(repr(e))
    sys.path[0:0] = [workdir]
    sys.argv = [cfg["main"]]
    sys.dont_write_bytecode = True
    if cfg.get("audit"):
        audit_hook(workdir)
    runpy.run_path(cfg["main"], run_name="__main__")


main()
