"""Start Python services by forking a process that has already imported torch and transformers.

Every radixserve process imports torch and transformers before it can do anything: seconds of CPU
on each start (docs/development.md has the figures). ``radixserve serve``'s launcher starts its
services, and restarts them, many times over its life; so it keeps one *zygote*, a process that has
done those imports once and forks a child for each service. The child sets itself up as
``subprocess.Popen`` would have (its own session, its stdin/stdout/stderr and passed fds, working
directory and environment, every other fd closed), then runs the service module as
``python -m radixserve.common.child MODULE`` does.

A fork copies what the imports left behind, so a child is forked only when it would have imported
them the same way: the zygote has no thread, has touched no GPU and opened no gRPC channel, and
the child's environment agrees with the zygote's on every variable those imports read (``PYTHON*``,
``HF_*``, ``TORCH*``, ``OMP_*``...; ``IMPORT_TIME_ENV``). Otherwise, or with ``RADIXSERVE_ZYGOTE=0``,
or when the zygote is gone, ``spawn`` starts the child with ``subprocess.Popen`` as before.

The zygote is the parent of what it forks: it reaps them and tells the launcher each exit status.
It exits when the launcher does (its end of the socket closes), and its children then get the death
signal the launcher's own children get (``child.die_with_parent``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import IO, Protocol

from radixserve.common.child import PR_SET_NAME, prctl, run

log = logging.getLogger(__name__)

PRELOAD = (
    "torch", "numpy", "safetensors", "transformers.utils.type_validators", "transformers.activations",
    "transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto",
    "transformers.generation.configuration_utils", "transformers.tokenization_utils_tokenizers",
    "radixserve.scheduler.engine",
)  # fmt: skip
# Read by the interpreter or by the preloaded modules when they are imported: a child whose value
# differs from the zygote's must import them itself.
IMPORT_TIME_ENV = (
    "PYTHON", "LD_", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "USE_", "TORCH", "PYTORCH",
    "OMP_", "MKL_", "KMP_", "OPENBLAS", "CUDA", "NVIDIA", "NCCL", "GLOO", "TRITON", "XDG_CACHE", "HOME",
    "LANG", "LC_", "TZ", "TMPDIR",
)  # fmt: skip
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16
_REAP_EVERY_S = 0.05
ORPHAN_GRACE_S = 10.0  # a dead zygote's children: this long to end on their death signal


class ChildProcess(Protocol):
    """What the launcher needs of a started service: ``subprocess.Popen``'s own subset."""

    pid: int
    stderr: IO[bytes] | None

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


@dataclass(frozen=True)
class SpawnRequest:
    """The launcher's request to the zygote (JSON; the fds travel beside it, in ``fds``' order)."""

    argv: list[str]  # the module, then its arguments
    env: dict[str, str]
    cwd: str
    fds: list[int]  # the child's fd numbers for the fds passed

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> SpawnRequest:
        raw = json.loads(data)
        return cls(
            [str(x) for x in raw["argv"]],
            {str(k): str(v) for k, v in raw["env"].items()},
            str(raw["cwd"]),
            [int(x) for x in raw["fds"]],
        )


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class ForkedProcess:
    """A child the zygote forked: Popen's interface, its exit status told by the zygote. It is
    signalled through a pidfd the zygote opened before it could be reaped, so a signal can never
    reach another process that got its pid after the zygote reaped it."""

    def __init__(
        self, pid: int, pidfd: int, zygote_pid: int, args: list[str], stderr: IO[bytes] | None = None
    ) -> None:
        self.pid, self.zygote_pid, self.args, self.stderr = pid, zygote_pid, args, stderr
        self._pidfd = pidfd
        self._lock = threading.Lock()
        self._code: int | None = None
        self._exited = threading.Event()

    @property
    def returncode(self) -> int | None:
        return self._code

    def exited(self, code: int) -> None:
        with self._lock:
            self._code = code
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        self._exited.set()

    def poll(self) -> int | None:
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self._code is not None
        return self._code

    def send_signal(self, sig: int) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL to its process group (it leads it) while it runs: the group id is its pid."""
        with self._lock, contextlib.suppress(ProcessLookupError, PermissionError):
            if self._pidfd >= 0 and not _readable(self._pidfd):  # not yet ended: the group is its
                os.killpg(self.pid, signal.SIGKILL)

    def exit_fd(self) -> int:
        """A new fd that is readable once it has ended (a duplicate of its pidfd)."""
        with self._lock:
            if self._pidfd >= 0:
                return os.dup(self._pidfd)
        r, w = os.pipe()
        os.close(w)  # at EOF: readable
        return r


def _readable(fd: int, timeout: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def kill_group(child: ChildProcess) -> None:
    """SIGKILL to ``child``'s process group, as long as the group is still its own."""
    if isinstance(child, ForkedProcess):
        child.kill_group()
    elif child.poll() is None:  # ours: not waited for, so its pid (the group's id) is not reused
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)


class Zygote:
    """The launcher's end: start the zygote, ask it for children, learn their exit statuses."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.common.zygote", str(theirs.fileno()), *preload],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # the terminal's Ctrl-C is the launcher's to handle
            env={k: v for k, v in self.env.items() if k != "RADIXSERVE_PARENT_PID"},
        )
        theirs.close()
        self.pid = self.proc.pid
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time: a reply follows its request
        self._replies: list[dict[str, object]] = []
        self._reply = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self.alive = True
        threading.Thread(target=self._read, name="zygote", daemon=True).start()

    def usable_for(self, env: Mapping[str, str]) -> bool:
        return self.alive and _import_time_env(env) == _import_time_env(self.env)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        fds: Mapping[int, int],
        stderr: int = -1,
    ) -> ForkedProcess:
        """``python -m radixserve.common.child *argv`` as a fork; ``fds``: the child's fd -> ours
        (0, 1 and 2 among them), closed here by the caller afterwards; ``stderr``: our end of its
        stderr pipe, the child's ``.stderr`` once it started (the caller's to close if not).
        OSError if the zygote is gone."""
        env = {**env, "RADIXSERVE_PARENT_PID": str(self.pid)}  # its parent: it dies with us
        request = SpawnRequest(list(argv), env, os.getcwd(), list(fds))
        with self._lock:
            if not self.alive:
                raise OSError("the zygote is gone")
            try:
                socket.send_fds(self._sock, [request.encode()], list(fds.values()))
            except OSError as e:
                self._fail()
                raise OSError(f"the zygote took no request: {e}") from e
            with self._reply:
                # The first request waits for the zygote's imports.
                self._reply.wait_for(lambda: bool(self._replies) or not self.alive, timeout=300)
                reply = self._replies.pop(0) if self._replies else None
            if reply is None:
                self._fail()  # no reply may come late: a service nobody would know of
                raise OSError("the zygote did not answer")
        if "error" in reply:
            raise OSError(str(reply["error"]))
        pid, pidfd = int(str(reply["pid"])), int(str(reply["pidfd"]))
        args = [sys.executable, "-m", "radixserve.common.child", *argv]
        child = ForkedProcess(pid, pidfd, self.pid, args, os.fdopen(stderr, "rb") if stderr >= 0 else None)
        with self._reply:
            early = self._children.pop(pid, None)  # it exited before we got here
            if early is None:
                self._children[pid] = child
        if early is not None and early.returncode is not None:
            child.exited(early.returncode)
        return child

    def _fail(self) -> None:
        """Give this zygote up: it ends, and so do the children it forked (their death signal)."""
        self.alive = False
        self.proc.kill()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, _MAX_MESSAGE, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                break
            msg = json.loads(data)
            with self._reply:
                if "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    child = self._children.pop(pid, None)
                    if child is None:  # its spawn reply is still on its way to ``spawn``
                        child = self._children[pid] = ForkedProcess(pid, -1, self.pid, [])
                    child.exited(code)
                else:
                    if fds:
                        msg["pidfd"] = fds[0]
                    self._replies.append(msg)
                    self._reply.notify_all()
        with self._reply:
            self.alive = False
            self._reply.notify_all()
            orphans, self._children = list(self._children.values()), {}
        self._end_orphans(orphans)
        self.proc.wait()

    @staticmethod
    def _end_orphans(orphans: list[ForkedProcess]) -> None:
        """The zygote is gone (killed, or a bug) and nobody can wait for its children: they got
        their death signal (SIGTERM) and have ORPHAN_GRACE_S to end on it, then are killed.
        Their exit status is unknown: -SIGTERM for one that ended on its own, else -SIGKILL."""
        deadline = time.monotonic() + ORPHAN_GRACE_S
        for child in orphans:
            fd = child.exit_fd()
            try:
                ended = _readable(fd, max(0.0, deadline - time.monotonic()))
                if not ended:
                    child.kill_group()
                    child.kill()
                    _readable(fd, 5.0)
            finally:
                os.close(fd)
            child.exited(-signal.SIGTERM if ended else -signal.SIGKILL)

    def close(self) -> None:
        """The zygote exits; children it forked get their death signal."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()  # the parent's: its socket and reader are not ours


os.register_at_fork(after_in_child=_forget_after_fork)


def running() -> Zygote | None:
    """This process's zygote if ``shared`` started one (and it is alive); never starts one."""
    return _shared if _shared is not None and _shared.alive else None


def parent_pid(child: ChildProcess) -> int:
    """The pid of ``child``'s parent: its zygote's, or ours."""
    return child.zygote_pid if isinstance(child, ForkedProcess) else os.getpid()


def shared() -> Zygote | None:
    """This process's zygote, started at the first call; None when ``RADIXSERVE_ZYGOTE=0``."""
    global _shared
    if os.environ.get("RADIXSERVE_ZYGOTE", "1") == "0":
        return None
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = Zygote()
        return _shared


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    pass_fds: Sequence[int] = (),
    stderr_pipe: bool = False,
    new_session: bool = True,
    zygote: Zygote | None = None,
) -> ChildProcess:
    """``python -m radixserve.common.child *argv``: forked by ``zygote`` when it can be (always in
    its own session), else started with Popen (in its own session if ``new_session``).
    ``stderr_pipe``: its stderr is a pipe, ``.stderr`` our end."""
    if zygote is not None and zygote.usable_for(env) and _valid(0) and _valid(1):
        r, w = os.pipe() if stderr_pipe else (-1, 2)
        fds = {0: 0, 1: 1, 2: w, **{fd: fd for fd in pass_fds}}
        try:
            return zygote.spawn(argv, env, fds, r)
        except OSError as e:
            log.warning("zygote: %s; starting %s without it", e, argv[0])
            if stderr_pipe:
                os.close(r)
        finally:
            if stderr_pipe:
                os.close(w)
    return subprocess.Popen(
        [sys.executable, "-m", "radixserve.common.child", *argv],
        env=dict(env),
        pass_fds=tuple(pass_fds),
        stderr=subprocess.PIPE if stderr_pipe else None,
        start_new_session=new_session,
    )


def _valid(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------ the zygote itself
def _serve(sock: socket.socket) -> list[str] | None:
    """Fork a child for each request until the launcher goes; returns a child's argv in the child."""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], _REAP_EVERY_S)
        _reap(sock, children)
        if not ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
        except OSError:
            return None
        if not data:
            return None
        try:
            request = SpawnRequest.decode(data)
            for stream in (sys.stdout, sys.stderr):  # nothing of ours reaches the child's stdio
                stream.flush()
            pid = os.fork()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"{type(e).__name__}: {e}"})
            continue
        if pid == 0:
            sock.close()
            _become(request, fds)
            return request.argv
        children.add(pid)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)  # before it can be reaped: the launcher signals through it
        try:
            with contextlib.suppress(OSError):
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
        finally:
            os.close(pidfd)


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, msg: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: the next receive ends the loop
        sock.send(json.dumps(msg).encode())


def _become(request: SpawnRequest, fds: list[int]) -> None:
    """In the forked child: what Popen(start_new_session=True, pass_fds=..., env=..., cwd=...) does."""
    import fcntl

    os.setsid()
    # What ``ps -o comm``, ``top`` and /proc/PID/comm show (its command line stays the zygote's).
    prctl(PR_SET_NAME, request.argv[0].rsplit(".", 1)[-1].encode()[:15])
    targets = request.fds
    above = max([*targets, *fds])
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, above + 1) for fd in fds]  # out of the targets' way
    for target, fd in zip(targets, high, strict=True):
        os.dup2(fd, target)  # inheritable, as Popen leaves them
    keep = set(targets)
    for fd in _open_fds():
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    # As a fresh interpreter would set them up for these fds (the zygote's stdout was /dev/null).
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd))  # type: ignore[union-attr]
    if "numpy.random" in sys.modules:  # a fresh process seeds its global generator from the OS
        sys.modules["numpy.random"].seed()


def _open_fds() -> list[int]:
    try:
        return [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def main() -> None:
    """``python -m radixserve.common.zygote FD MODULE...``: import MODULEs, then serve FD.

    No death signal of its own (that fires when the launcher's *thread* that started it ends, and
    any of the launcher's threads may be first to ask): it ends when the launcher's end of FD
    closes, which only the launcher's exit or ``Zygote.close`` does."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:]:
        __import__(name)
    argv = _serve(sock)
    if argv is not None:
        run(argv)  # in a forked child: its service, then this interpreter's normal exit


if __name__ == "__main__":
    main()
