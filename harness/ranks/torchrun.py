"""Running cases under torchrun (NCCL, one rank per GPU, single- or multi-node).

Every torchrun process is a rank. Rank 0 plays the parent: it draws cases, computes the oracle and
judges, exactly as with the CPU pool; the other ranks follow. `TorchrunPool` has the pool's
submit/collect interface, so `runner.run_case` and every command work unchanged. Cases and replies
travel over a gloo control group; the ring itself runs on the default (NCCL) group's subgroups.
A per-case watchdog thread enforces the deadline: torchrun cannot restart one rank, so a hang dumps
every rank's stack and ends the job (torchrun tears the rest down) with exit status 124.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import threading
import time

import torch

from harness import case as case_mod
from harness.ranks.backend import choose_backend, device_for, nccl_host_per_rank, require_cuda
from harness.ranks.execute import Groups, handle_case, handle_oracle
from harness.ranks.protocol import (
    OK,
    ORACLE,
    RUN,
    STOP,
    OracleMessage,
    OraclePass,
    PoolReply,
    RunMessage,
    StopMessage,
    TorchrunTicket,
)

HANG_EXIT = 124


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process (its rendezvous variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


class _Watchdog:
    """Deadline for one case on this rank: dump all stacks and exit if it passes."""

    def __init__(self, rank: int, deadline_s: float, what: str) -> None:
        self.timer = threading.Timer(deadline_s, self._fire, args=(rank, deadline_s, what))
        self.timer.daemon = True
        self.timer.start()

    @staticmethod
    def _fire(rank: int, deadline_s: float, what: str) -> None:
        sys.stderr.write(
            f"ring-harness: rank {rank}: verdict hang: {what} passed its deadline of "
            f"{deadline_s:g} s; "
            f"stack follows\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HANG_EXIT)

    def cancel(self) -> None:
        self.timer.cancel()


def _say_error(rank: int, reply: dict) -> None:
    """Print this rank's own error at once: under NCCL a blocked peer may never gather it."""
    if isinstance(reply, dict) and reply.get("error"):
        sys.stderr.write(f"ring-harness: rank {rank}: {reply['error']}\n")
        sys.stderr.flush()


def _lost_peer(rank: int, case_id: int, e: BaseException) -> None:
    """A peer ended while the ranks gathered a case's results: torchrun cannot restart it."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    sys.stderr.write(
        f"ring-harness: rank {rank}: a peer rank ended during case {case_id} "
        f"(gathering its results: {first}); torchrun's summary names the rank and its exit status\n"
    )
    sys.stderr.flush()
    os._exit(1)


def _share_gpu(backend: str) -> None:
    """Make this rank a node of its own to NCCL before NCCL starts (`--share-gpu`)."""
    from harness.errors import HarnessError

    require_cuda("--share-gpu")
    if backend != "nccl":
        raise HarnessError(
            f"--share-gpu is for NCCL ranks; the backend is {backend} "
            "(gloo ranks on a GPU: the local pool's --device cuda)"
        )
    os.environ.update(nccl_host_per_rank(int(os.environ["RANK"]), os.environ))


class TorchrunPool:
    """The `Pool` interface (harness.ranks.protocol) over torchrun's processes: use on rank 0; the
    other ranks call `follow`. A `Pool[TorchrunTicket]`."""

    def __init__(self, backend: str | None = None, share_gpu: bool = False) -> None:
        import torch.distributed as dist

        self.backend = choose_backend(backend)
        if share_gpu:
            _share_gpu(self.backend)
        self.device = device_for(self.backend, share_gpu)
        # CPU ranks: flash-attn's CPU stand-in, only where no real flash-attn exists
        if self.backend == "gloo":
            from harness.kernels import flash_standin

            flash_standin.install()
        if not dist.is_initialized():
            dist.init_process_group(
                self.backend, init_method="env://", timeout=datetime.timedelta(seconds=300)
            )
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.capacity = self.size  # torchrun's world never changes
        self.ctrl = dist.new_group(backend="gloo")
        self.groups = Groups(self.backend)
        self.impls: dict = {}
        self._case_id = 0
        self.starts = 1
        self.broken = False  # never: a hang ends the whole job instead
        self.fresh_group = False  # never: groups are not rebuilt under torchrun

    def _broadcast(
        self, msg: RunMessage | OracleMessage | StopMessage | None
    ) -> RunMessage | OracleMessage | StopMessage:
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def _gather(self, reply):
        """Every rank's reply on rank 0. A rank that ended ends the job: one line, exit 1."""
        import torch.distributed as dist

        _say_error(self.rank, reply)
        out = [None] * self.size if self.rank == 0 else None
        try:
            dist.gather_object(reply, out, dst=0, group=self.ctrl)
        except RuntimeError as e:
            _lost_peer(self.rank, self._case_id, e)
        return out

    def ensure(self, size: int, exact: bool = False) -> bool:
        """Torchrun's ranks are fixed: fine when they fit the case, a HarnessError otherwise."""
        if size > self.size or (exact and size != self.size):
            from harness.errors import HarnessError

            raise HarnessError(
                f"case needs {'exactly ' if exact else ''}{size} ranks but torchrun "
                f"started {self.size}"
            )
        return False

    def submit(
        self,
        case: case_mod.Case,
        impl: str | None = None,
        *,
        allow_import: bool = False,
        leak: bool = True,
        whole_world: bool = False,
        profile: bool = False,
    ) -> TorchrunTicket:
        """Broadcast the case and run rank 0's share of it now (under the case's watchdog)."""
        self.ensure(case.pool_size, exact=whole_world)
        self._case_id += 1
        msg = RunMessage(
            op=RUN,
            case=case_mod.to_dict(case),
            impl=impl or case.impl,
            allow_import=allow_import,
            leak=leak,
            profile=profile,
            case_id=self._case_id,
        )
        self._broadcast(msg)
        start = time.monotonic()
        dog = _Watchdog(self.rank, case.deadline_s, f"case {self._case_id} ({case.summary()})")
        reply = handle_case(msg, self.rank, self.groups, self.device, self.impls)
        return TorchrunTicket(start=start, reply=reply, dog=dog)

    def collect(self, ticket: TorchrunTicket) -> PoolReply:
        """Gather every rank's result of the case (the watchdog still guards the wait)."""
        replies = self._gather(ticket["reply"])
        ticket["dog"].cancel()
        return PoolReply(
            replies={r: rep for r, rep in enumerate(replies)},
            wall_s=time.monotonic() - ticket["start"],
        )

    def oracle(
        self,
        case: case_mod.Case,
        timeout_s: float,
        oracle_pass: OraclePass = "rows",
        stats: tuple | None = None,
    ) -> dict[int, tuple]:
        """One pass of every ring rank's share of the case's oracle, each computed on its own device
        (cuda:LOCAL_RANK under NCCL) outside the fault interposer and gathered over the control
        group; group rank -> (float64 part, base part). A rank's error raises PoolError; the
        watchdog guards `timeout_s`."""
        from harness.errors import PoolError

        msg = OracleMessage(
            op=ORACLE, case=case_mod.to_dict(case), case_id=self._case_id, oracle_pass=oracle_pass
        )
        if stats is not None:
            msg["stats"] = stats
        self._broadcast(msg)
        what = f"the oracle ({oracle_pass} pass) of {case.summary()}"
        dog = _Watchdog(self.rank, timeout_s, f"{what} (case {self._case_id})")
        replies = self._gather(handle_oracle(msg, self.rank, self.device))
        dog.cancel()
        parts = {}
        for r, rep in enumerate(replies):
            if case.group_offset <= r < case.group_offset + case.world_size:
                if rep.get("status") != OK:
                    raise PoolError(f"{what}: rank {r}: {rep.get('error')}")
                parts[r - case.group_offset] = rep["parts"]
        return parts

    def follow(self) -> None:
        """Non-zero ranks: run every case rank 0 broadcasts until it says stop."""
        while True:
            msg = self._broadcast(None)
            if msg["op"] == STOP:
                return
            if msg["op"] == ORACLE:
                # rank 0's watchdog guards the wait
                self._gather(handle_oracle(msg, self.rank, self.device))
                continue
            case = case_mod.from_dict(msg["case"])
            dog = _Watchdog(self.rank, case.deadline_s, f"case {msg['case_id']} ({case.summary()})")
            reply = handle_case(msg, self.rank, self.groups, self.device, self.impls)
            self._gather(reply)
            dog.cancel()

    def close(self) -> None:
        """Rank 0 tells the followers to stop; every rank leaves the process group."""
        import torch.distributed as dist

        if self.rank == 0 and dist.is_initialized():
            self._broadcast(StopMessage(op=STOP))
        if dist.is_initialized():
            dist.destroy_process_group()

    def pids(self) -> list[int]:
        """This process only: torchrun owns the others."""
        return [os.getpid()]

    def __enter__(self) -> TorchrunPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def torch_threads_for_rank() -> None:
    """Leave the CPU to the GPUs' host threads: one intra-op thread per rank process."""
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    )
