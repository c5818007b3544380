"""Running cases under torchrun (NCCL, one rank per GPU, single- or multi-node).

Every torchrun process is a rank. Rank 0 plays the parent: it draws cases, computes the oracle and
judges, exactly as with the CPU pool; the other ranks follow. `TorchrunPool` has the pool's
submit/collect interface, so `runner.run_case` and every command work unchanged. Cases and replies
travel over a gloo control group; the ring itself runs on the default (NCCL) group's subgroups.
A per-case watchdog thread enforces the deadline: torchrun cannot restart one rank, so a hang dumps
every rank's stack and ends the job (torchrun tears the rest down) with exit status 124. A peer
that ended (a lost host, a killed rank) ends the job in one line per rank, naming the ranks that no
longer answer a roll call over torchrun's store.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import re
import sys
import threading
import time

import torch

from harness import case as case_mod
from harness.ranks.backend import choose_backend, device_for, nccl_host_per_rank, require_cuda
from harness.ranks.execute import handle_case, handle_oracle
from harness.ranks.groups import Groups
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
ROLL_CALL_S = 3.0  # how long a rank that lost a peer waits for the others to answer


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


def _gloo_line(e: BaseException) -> str:
    """The first line of a communication error, without gloo's source path and its advice."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]
    return first[:300]


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _lost_peer(rank: int, case_id: int, e: BaseException, doing: str, call: RollCall) -> None:
    """A peer ended while this rank talked to the others: torchrun cannot restart it. The roll call
    says which ranks are gone (on a lost host, torchrun here names only this host's ranks)."""
    lost = call.missing()
    if lost is None:
        who = (
            f"; torchrun's store at {call.address} does not answer either: "
            "the host that held it is gone, or its agent"
        )
    elif lost:
        their = "its host or process" if len(lost) == 1 else "their host or processes"
        who = f"; {_names(lost)} did not answer within {ROLL_CALL_S:g} s: {their} ended"
    else:
        who = "; torchrun's summary names the rank and its exit status"
    sys.stderr.write(
        f"ring-harness: rank {rank}: a peer rank ended during case {case_id} "
        f"({doing}: {_gloo_line(e)}){who}\n"
    )
    sys.stderr.flush()
    os._exit(1)


class RollCall:
    """Which ranks are still there once a peer has ended, asked over torchrun's store (its agent's,
    which outlives every rank). Each rank keeps a thread with a store client of its own that answers
    even while the rank is blocked in a collective. A rank that lost a peer calls the roll and
    waits up to `ROLL_CALL_S` for every answer."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        # one call per attempt: a restarted worker group must not see the last one's
        self.key = f"ring-harness/roll-call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        # only the agent's store outlives rank 0 (torchrun's static and c10d rendezvous)
        self.enabled = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and all(
            k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT")
        )
        self.store_gone = False  # the answering thread saw the store end
        if self.enabled:
            threading.Thread(
                target=self._answer, name="ring-harness-roll-call", daemon=True
            ).start()

    def _store(self, timeout_s: float):
        import torch.distributed as dist

        host, port = self.address.rsplit(":", 1)
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )

    def _answer(self) -> None:
        import torch.distributed as dist

        try:
            store = self._store(60)
            while True:
                try:  # c10d prints a warning at each timeout of a wait: one a week
                    store.wait([f"{self.key}/called"], datetime.timedelta(days=7))
                    break
                except dist.DistStoreError:
                    continue
            store.set(f"{self.key}/here/{self.rank}", "1")
            store.add(f"{self.key}/answers", 1)
        except Exception:  # the store is gone: the caller says so
            self.store_gone = True

    def missing(self) -> list[int] | None:
        """Call the roll: the ranks that did not answer within ROLL_CALL_S ([] without an agent's
        store to ask), None when the store itself does not answer."""
        if not self.enabled:
            return []
        if self.store_gone:
            return None
        try:
            store = self._store(ROLL_CALL_S)
            store.set(f"{self.key}/called", "1")
            end = time.monotonic() + ROLL_CALL_S
            while store.add(f"{self.key}/answers", 0) < self.size and time.monotonic() < end:
                time.sleep(0.05)
            return [r for r in range(self.size) if not store.check([f"{self.key}/here/{r}"])]
        except Exception:
            return None


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
        self.roll_call = RollCall(self.rank, self.size)
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
        try:
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
        except RuntimeError as e:
            doing = "sending the next message" if self.rank == 0 else "waiting for the next case"
            _lost_peer(self.rank, self._case_id, e, doing, self.roll_call)
        return box[0]

    def _gather(self, reply, dog: _Watchdog | None = None):
        """Every rank's reply on rank 0. A rank that ended ends the job: one line, exit 1 (the
        roll call's wait is not a hang: `dog` stops first)."""
        import torch.distributed as dist

        _say_error(self.rank, reply)
        out = [None] * self.size if self.rank == 0 else None
        try:
            dist.gather_object(reply, out, dst=0, group=self.ctrl)
        except RuntimeError as e:
            if dog is not None:
                dog.cancel()
            _lost_peer(self.rank, self._case_id, e, "gathering its results", self.roll_call)
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
        replies = self._gather(ticket["reply"], ticket["dog"])
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
        replies = self._gather(handle_oracle(msg, self.rank, self.device), dog)
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
            self._case_id = msg["case_id"]  # rank 0's count, for this rank's own lines
            if msg["op"] == ORACLE:
                # rank 0's watchdog guards the wait
                self._gather(handle_oracle(msg, self.rank, self.device))
                continue
            case = case_mod.from_dict(msg["case"])
            dog = _Watchdog(self.rank, case.deadline_s, f"case {msg['case_id']} ({case.summary()})")
            reply = handle_case(msg, self.rank, self.groups, self.device, self.impls)
            self._gather(reply, dog)
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
