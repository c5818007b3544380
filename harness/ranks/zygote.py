"""Rank workers forked from a process that has already imported torch (a zygote), not started
afresh.

A fresh worker interpreter spends ~1.5 s of CPU importing torch and warming autograd up; on 2 cores
that was most of what a pool start, a fresh-rank confirmation or a restart after a dead rank cost.
The zygote pays it once per owner process: `python -m harness.ranks.worker --zygote`,
single-threaded on the Python side, never touching a device, forks one child per request. The child
leads its own session, takes the request's environment, log file and arguments, and runs the
worker's main, exactly as a spawned worker does. The zygote reaps its children and reports each exit
status, so the owner holds a `Forked` handle that answers like `subprocess.Popen` (pid, poll, wait,
returncode).

The chain dies with the owner: the zygote watches the owner (PDEATHSIG and a poll), each worker
watches the zygote. A worker's command line is the zygote's, which names `harness.ranks.worker` and
`--parent <owner pid>`, so the leftover checks (harness.ranks.leftovers) see it as before.
`RING_HARNESS_FORK=0` spawns every worker afresh instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

from harness import interrupt

FORK_ENV = "RING_HARNESS_FORK"  # "0": spawn each worker afresh (no zygote)
# per pool or per test: not the zygote's business
VOLATILE = ("RING_HARNESS_AUTHKEY", "PYTEST_CURRENT_TEST")
# what the zygote's imports (python, torch and its libraries) may read from the environment: a
# zygote serves the pools whose environment agrees on these; a child takes its pool's whole
# environment before it runs
IMPORT_ENV = (
    "PYTHON",
    "LD_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL",
    "GLOO",
    "HIP",
    "ROCM",
    "TRITON",
)
START_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 30.0


# why a zygote of this process could not start: then workers are spawned afresh
_FAILED: list[str] = []


def enabled() -> bool:
    return (
        os.environ.get(FORK_ENV, "1") != "0"
        and not _FAILED
        and hasattr(os, "fork")
        and sys.platform.startswith("linux")
    )


class Forked:
    """A worker forked by a zygote, with the part of `subprocess.Popen`'s interface the pool
    uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self.args = args  # the worker's arguments, as Popen keeps its command

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_status(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The owner's side: start the zygote, ask it for children, collect their exit statuses."""

    def __init__(self, env: dict[str, str]) -> None:
        self.owner = os.getpid()
        cmd = [
            sys.executable,
            "-m",
            "harness.ranks.worker",
            "--zygote",
            "--parent",
            str(self.owner),
        ]
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._replies: list[str] = []
        self._ready = False
        self._dead = False
        self._lock = threading.Lock()  # one request at a time
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            with self._cond:
                while not self._cond.wait_for(lambda: self._ready or self._dead, interrupt.POLL_S):
                    # a stop request (SIGTERM) does not wait for the import
                    interrupt.check("starting the ranks")
                    if time.monotonic() > deadline:
                        raise OSError(
                            f"the worker zygote did not start within {START_TIMEOUT_S:.0f} s"
                        )
            if self._dead:
                raise OSError(
                    f"the worker zygote exited during its start (exit {self.proc.poll()})"
                )
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for raw in self.proc.stdout:
            kind, _, rest = raw.decode(errors="replace").strip().partition(" ")
            with self._cond:
                if kind == "exit" and len(rest.split()) == 2:
                    pid, code = rest.split()
                    self._exits[int(pid)] = int(code)
                elif kind == "ready":
                    self._ready = True
                elif kind in ("pid", "error"):
                    self._replies.append(raw.decode(errors="replace").strip())
                self._cond.notify_all()
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def alive(self) -> bool:
        """Running, and this process's own (a forked copy of the owner must not use the owner's
        pipes)."""
        return self.owner == os.getpid() and not self._dead and self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], log: str) -> Forked:
        """A child running the worker's main with `argv`, `env`, its output to `log` (appended)."""
        request = json.dumps({"argv": argv, "env": env, "log": log, "cwd": os.getcwd()}) + "\n"
        with self._lock:
            try:
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except (OSError, ValueError) as e:
                raise OSError(f"the worker zygote is gone: {e}") from None
            with self._cond:
                if not self._cond.wait_for(lambda: self._replies or self._dead, REPLY_TIMEOUT_S):
                    raise OSError(f"the worker zygote did not fork within {REPLY_TIMEOUT_S:.0f} s")
                if not self._replies:
                    raise OSError("the worker zygote exited")
                reply = self._replies.pop(0)
        kind, _, rest = reply.partition(" ")
        if kind != "pid":
            raise OSError(f"the worker zygote could not fork: {rest}")
        return Forked(self, int(rest), [sys.executable, "-m", "harness.ranks.worker", *argv])

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status as Popen gives it (-N: signal N); None while it runs. When the
        zygote is gone, a child that no longer exists counts as killed (its status went with the
        zygote)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._dead, timeout)
            if pid in self._exits:
                return self._exits[pid]
        if self._dead and not _exists(pid):
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        """Stop the zygote (its stdin closes; it exits). Its live children, if any, die with it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


_ZYGOTES: dict[tuple, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def worker_env() -> dict[str, str]:
    """The environment a pool's workers start with, less the pool's own key.

    The ranks import what the parent can: this project, then the caller's directory (as
    `python -m` does, so `--impl myring:my_ring` works from the folder holding myring.py), then
    PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.getcwd(), env.get("PYTHONPATH")]))
    return env


def prestart() -> None:
    """Start this process's zygote now, in the background, for a command about to start ranks.

    Its import of torch (about 2 s here) then overlaps the command's own. The pool's first
    `zygote_for` waits for it, or starts one itself if this one failed."""
    if not enabled():
        return

    def start() -> None:
        try:
            zygote_for(worker_env())
        except BaseException:  # the pool tries again and reports
            return
        # the zygote's PDEATHSIG follows the thread that started it: this one lives on
        threading.Event().wait()

    threading.Thread(target=start, daemon=True, name="zygote-prestart").start()


def zygote_for(env: dict[str, str]) -> Zygote:
    """This process's zygote for `env` (what it imported depends on the IMPORT_ENV variables and the
    working directory); started on first use, kept until the process exits."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV))) + (
        ("cwd", os.getcwd()),
    )
    with _ZYGOTES_LOCK:
        z = _ZYGOTES.get(key)
        if z is None or not z.alive():
            try:
                z = _ZYGOTES[key] = Zygote({k: v for k, v in env.items() if k not in VOLATILE})
            except OSError as e:
                # the pool spawns its workers instead, from now on (they show their errors)
                _FAILED.append(str(e))
                raise
        return z


def zygote_pids() -> set[int]:
    """The live zygotes of this process (not workers, though their command lines say so)."""
    return {z.proc.pid for z in _ZYGOTES.values() if z.alive()}


@atexit.register
def close_all() -> None:
    with _ZYGOTES_LOCK:
        for z in _ZYGOTES.values():
            if z.owner == os.getpid():
                z.close()
        _ZYGOTES.clear()


# -- the zygote process --------------------------------------------------------------------------


def serve(owner: int, preload: Callable[[], None], entry: Callable[[list[str], int], None]) -> None:
    """Run as the zygote: `preload()` once, then fork a child per request line on stdin, which runs
    `entry(argv, zygote_pid)` (the worker's main); report each child's pid and exit status on
    stdout, until stdin closes or the owner dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    stdin = sys.stdin.buffer
    children: set[int] = set()
    buf = b""
    while os.getppid() == owner:
        ready, _, _ = select.select([stdin, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if stdin in ready:
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                break  # the owner is done; a child still running dies with the zygote (PDEATHSIG)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    pid = _fork_one(
                        json.loads(line), entry, (stdin.fileno(), out.fileno(), wake_r, wake_w)
                    )
                    children.add(pid)
                    out.write(f"pid {pid}\n".encode())
                except Exception as e:  # noqa: BLE001 (reported to the owner, which raises it)
                    out.write(
                        f"error {type(e).__name__}: {e}\n".replace("\n", " ").strip().encode()
                        + b"\n"
                    )
                out.flush()
        for pid in list(children):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if got:
                children.discard(pid)
                out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
                out.flush()
    os._exit(0)


def _fork_one(req: dict, entry: Callable[[list[str], int], None], fds: tuple[int, ...]) -> int:
    argv, env, log = list(req["argv"]), dict(req["env"]), str(req["log"])
    logfd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    me = os.getpid()
    pid = os.fork()
    if pid:
        os.close(logfd)
        return pid
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # over the zygote's request pipe
        os.dup2(logfd, 1)  # over its reply pipe
        os.dup2(logfd, 2)
        for fd in {null, logfd, *fds} - {0, 1, 2}:
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req.get("cwd") or "/")
        import random

        random.seed()  # a fresh interpreter's seed, not the zygote's state
        sys.argv = ["harness.ranks.worker", *argv]
        entry(argv, me)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
