"""Starting a pool's worker processes, and connecting to each one.

The workers of one set share a private dir. Each worker is forked from the zygote when one runs,
else spawned afresh. Each leads its own session, writes its output to log-<r>.txt in the dir, and
is sampled by the parent's memory watcher (harness.ranks.oom). Runs in the parent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection

from harness import interrupt
from harness.errors import PoolError
from harness.ranks import oom, postmortem, zygote
from harness.ranks.backend import Placement

START_TIMEOUT_S = 120.0
# where the pool's ring-harness-* dir goes (default: tempfile.gettempdir())
TMPDIR_ENV = "RING_HARNESS_TMPDIR"
# AF_UNIX paths are 108 bytes with the terminating NUL, and rank<N>.sock must fit.
_SOCKET_PATH_MAX = 107


def temp_root() -> str:
    """Where a pool makes its private dir.

    It is $RING_HARNESS_TMPDIR, created if missing, else tempfile.gettempdir(). Tests point the
    variable at pytest's tmp_path. A root too deep for the ranks' Unix socket paths falls back to
    tempfile.gettempdir().
    """
    root = os.environ.get(TMPDIR_ENV) or tempfile.gettempdir()
    if (
        len(os.path.join(os.path.abspath(root), "ring-harness-xxxxxxxx", "rank9999.sock"))
        > _SOCKET_PATH_MAX
    ):
        return tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return root


@dataclass
class Workers:
    """A started set of workers: their dir, processes, auth key and size.

    The finalizer kills them and removes the dir. A pool's standby set is one (RankPool.spare).
    """

    dir: str
    procs: list[subprocess.Popen]
    authkey: bytes
    size: int
    finalizer: weakref.finalize


def launch(owner: object, size: int, backend: str, placement: Placement) -> Workers:
    """Start `size` worker processes in a new private dir, without waiting for them.

    Each imports torch, then waits for the pool to connect (harness.ranks.worker.serve). The set's
    finalizer runs at the latest when `owner` is garbage-collected.
    """
    workdir = tempfile.mkdtemp(prefix="ring-harness-", dir=temp_root())
    procs: list[subprocess.Popen] = []
    finalizer = weakref.finalize(owner, postmortem.kill_all, procs, workdir)
    authkey = os.urandom(16)
    env = dict(zygote.worker_env(), RING_HARNESS_AUTHKEY=authkey.hex())
    try:
        for r in range(size):
            procs.append(spawn_worker(workdir, size, r, env, backend, placement))
    except OSError as e:
        finalizer()
        raise PoolError(f"rank pool failed to start: {e}") from None
    return Workers(workdir, procs, authkey, size, finalizer)


def spawn_worker(
    workdir: str, size: int, r: int, env: dict[str, str], backend: str, placement: Placement
) -> subprocess.Popen:
    """Start worker rank r in its own session, its output to log-<r>.txt in its dir."""
    cmd = [
        sys.executable,
        "-m",
        "harness.ranks.worker",
        "--rank",
        str(r),
        "--size",
        str(size),
        "--dir",
        workdir,
        "--backend",
        backend,
        "--parent",
        str(os.getpid()),
        "--device",
        placement.device,
    ] + (["--stage-p2p"] if placement.stage_p2p else [])
    log = os.path.join(workdir, f"log-{r}.txt")
    # forked from a process that has imported torch already (harness.ranks.zygote)
    if zygote.enabled():
        try:
            return oom.watch(zygote.zygote_for(env).fork(cmd[3:], env, log))
        except OSError:
            # The zygote is there but could not fork: a real failure.
            if zygote.enabled():
                raise
    # spawned afresh: RING_HARNESS_FORK=0, or this process's zygote could not start
    with open(log, "wb") as f:
        return oom.watch(
            subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )


def connect(
    workdir: str, proc: subprocess.Popen, r: int, authkey: bytes, deadline: float
) -> Connection:
    """Connect to worker rank r's socket once it is listening, or raise PoolError."""
    path = os.path.join(workdir, f"rank{r}.sock")
    while True:
        if proc.poll() is not None:
            tail = postmortem.log_tail(workdir, r)
            raise PoolError(f"rank {r} exited with {proc.returncode} during start: {tail}")
        if os.path.exists(path):
            try:
                return Client(path, family="AF_UNIX", authkey=authkey)
            except (ConnectionRefusedError, FileNotFoundError):
                pass
        if time.monotonic() > deadline:
            tail = postmortem.log_tail(workdir, r)
            raise PoolError(f"rank {r} did not start within {START_TIMEOUT_S:.0f} s: {tail}")
        interrupt.check("starting the ranks")
        time.sleep(0.02)
