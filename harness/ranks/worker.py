"""One rank of the persistent pool: it receives cases from the parent, runs them, sends back shards.

harness.ranks.execute runs one case on a rank, and this module serves the messages. `HANDLERS` has
one handler per op. harness.ranks.protocol declares the messages.

harness.ranks.pool starts it as `python -m harness.ranks.worker`. It dies with its parent (PDEATHSIG
plus a watchdog thread). On SIGUSR1 it dumps its Python stack (faulthandler), so a hang names where
it waits. It runs inside a rank process: docs/architecture.md says what it may import.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import faulthandler
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener

import torch

from harness.kernels import flash_standin
from harness.ranks import gloo_device, wire
from harness.ranks.backend import Placement, choose_backend, device_for, rank_device
from harness.ranks.execute import handle_case, handle_oracle
from harness.ranks.groups import Groups
from harness.ranks.protocol import (
    ORACLE,
    PING,
    PONG,
    READY,
    RUN,
    STOP,
    Message,
    OracleMessage,
    PongMessage,
    ReadyMessage,
    RunMessage,
)


def _die_with_parent(parent: int) -> None:
    """Never outlive the parent: kernel PDEATHSIG where available, plus a polling thread."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _warm_up() -> None:
    """Do once at start what the first backward would otherwise do mid-ring.

    Torch imports sympy on the first backward with a given gradient, which takes seconds on a loaded
    machine. The other ranks' short-timeout waits then failed on the first case after every pool
    start or restart.
    """
    x = torch.ones(1, requires_grad=True)
    torch.autograd.backward(x * 2, torch.ones(1))


@dataclass
class Serving:
    """What a pool worker keeps between messages."""

    rank: int
    conn: Connection
    groups: Groups
    device: torch.device
    workdir: str
    impls: dict[str, object]
    stage: bool = False  # P2P through host buffers (harness.faults.staging)


def on_run(st: Serving, msg: RunMessage) -> bool:
    """Run the case and send its result."""
    wire.send(
        st.conn, handle_case(msg, st.rank, st.groups, st.device, st.impls, st.workdir, st.stage)
    )
    return True


def on_oracle(st: Serving, msg: OracleMessage) -> bool:
    """Compute one pass of this rank's oracle share and send it."""
    wire.send(st.conn, handle_oracle(msg, st.rank, st.device))
    return True


def on_ping(st: Serving, msg: Message) -> bool:
    """Answer that this rank is alive and idle."""
    wire.send(st.conn, PongMessage(op=PONG, rank=st.rank))
    return True


def on_stop(st: Serving, msg: Message) -> bool:
    """Leave the loop. The caller tears the process group down and exits."""
    return False


# every message a worker answers, one handler each; a handler returns whether to keep serving
HANDLERS: dict[str, Callable[[Serving, Message], bool]] = {
    RUN: on_run,
    ORACLE: on_oracle,
    PING: on_ping,
    STOP: on_stop,
}


def serve(
    rank: int, size: int, workdir: str, backend: str, placement: Placement | None = None
) -> None:
    """Rendezvous, then loop: receive a message and hand it to its handler.

    It exits on 'stop' or on the parent's death.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    _warm_up()
    authkey = bytes.fromhex(os.environ["RING_HARNESS_AUTHKEY"])
    stack_file = open(os.path.join(workdir, f"stack-{rank}.txt"), "a")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # a fatal signal (SIGSEGV in a backend) says where
    faulthandler.enable(file=sys.stderr, all_threads=True)
    with Listener(
        os.path.join(workdir, f"rank{rank}.sock"), family="AF_UNIX", authkey=authkey
    ) as lst:
        conn = lst.accept()
    placement = placement or Placement()
    backend = choose_backend(backend)
    device = device_for(backend) if backend == "nccl" else rank_device(placement, rank)
    # Make the CUDA context now, not in the first case's ring with its short timeouts.
    if device.type == "cuda":
        torch.ones(1, device=device).sum().item()
        if backend == "gloo":
            from harness.faults.staging import stage_functional_collectives

            stage_functional_collectives(device)
    # CPU ranks: flash-attn's CPU stand-in, only where no real flash-attn is importable
    if device.type == "cpu":
        flash_standin.install()
    if backend == "gloo":
        gloo_device.share_one_device()  # one loop thread for all of this rank's groups
    dist.init_process_group(
        backend,
        store=dist.FileStore(os.path.join(workdir, "store"), size),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    st = Serving(
        rank, conn, Groups(backend), device, workdir, {}, placement.staged and backend == "gloo"
    )
    wire.send(conn, ReadyMessage(op=READY, rank=rank, pid=os.getpid()))
    while True:
        try:
            msg = wire.recv(conn)
        except (EOFError, OSError):
            os._exit(0)
        handler = HANDLERS.get(msg.get("op"))
        if handler is None:
            raise ValueError(
                f"rank {rank}: unknown message op {msg.get('op')!r} (known: {', '.join(HANDLERS)})"
            )
        if not handler(st, msg):
            break
    dist.destroy_process_group()
    conn.close()


def _preload() -> None:
    """What the zygote does once for all its children (harness.ranks.zygote).

    It sets one intra-op thread. With a CPU-only torch, which cannot touch a device, it also does
    the autograd warm-up's imports.
    """
    torch.set_num_threads(1)
    if torch.version.cuda is None and torch.version.hip is None:
        _warm_up()
        # A checkpointed call imports torch._dynamo on its first use: about 1 s of CPU, once in
        # every rank. Here it is paid once for all the forked ranks.
        importlib.import_module("torch._dynamo")


def main(argv: list[str] | None = None, zygote_pid: int | None = None) -> None:
    """The entry point of a worker process. RankPool gives the arguments.

    `--zygote --parent PID` runs the zygote that forks the workers (harness.ranks.zygote).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--zygote"]:
        from harness.ranks import zygote

        zygote.serve(int(argv[argv.index("--parent") + 1]), _preload, main)
        return
    p = argparse.ArgumentParser(prog="harness.ranks.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--stage-p2p", action="store_true")
    a = p.parse_args(argv)
    # a forked worker dies with its zygote, which dies with the owner
    _die_with_parent(zygote_pid or a.parent)
    serve(a.rank, a.size, a.dir, a.backend, Placement(a.device, a.stage_p2p))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
