"""A persistent pool of rank processes: start once, run many cases, watch every deadline.

A case that passes its deadline gets each pending rank's stack. The pool is then torn down, and it
restarts on the next case. Workers die with the parent, so nothing is left running.
docs/long-sequences.md says how the ranks meet and how they are stopped. harness.ranks.spawn starts
the workers, and harness.ranks.postmortem reads what a dead or hung rank left. `RankPool.history`
keeps what the ranks ran since their last start, for failures that depend on what ran before.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from harness import case as case_mod
from harness import interrupt
from harness.errors import PoolError
from harness.ranks import groups, postmortem, spawn, wire
from harness.ranks.backend import Placement
from harness.ranks.protocol import (
    OK,
    ORACLE,
    ORACLE_RESULT,
    RUN,
    SETTLED,
    STOP,
    LocalTicket,
    OracleMessage,
    OraclePass,
    PoolReply,
    RunMessage,
    StopMessage,
)
from harness.ranks.spawn import START_TIMEOUT_S, TMPDIR_ENV, Workers

__all__ = ["PoolError", "PoolReply", "RankPool", "Ran", "TMPDIR_ENV"]

# Fresh process groups built after errors, before the pool is restarted instead.
MAX_HEALS = 24
# Runs kept in RankPool.history. The oldest is dropped first.
HISTORY_MAX = 256


@dataclass(frozen=True)
class Ran:
    """One run the ranks made since their last start.

    It holds the case, the implementation it ran under, and its import permission. `leak` says
    whether the leak run was asked for: a second forward and backward in the same case.
    """

    case: case_mod.Case
    impl: str
    leak: bool = True
    allow_import: bool = False
    whole_world: bool = False


class RankPool:
    """`size` worker ranks on `backend`. Use it as a context manager, or call close().

    `history` holds the runs since the last start, at most HISTORY_MAX. A start or a restart clears
    it. A failure that depends on what ran before, such as a buffer cached across calls and never
    zeroed, is reproduced from it.
    """

    def __init__(
        self,
        size: int = 4,
        backend: str = "gloo",
        *,
        spare: bool = False,
        placement: Placement | None = None,
    ) -> None:
        self.size = size
        self.capacity = size  # the largest size asked for: Pool.capacity
        self.backend = backend
        # the ranks' device and P2P staging (default: $RING_HARNESS_DEVICE, $RING_HARNESS_STAGE_P2P)
        self.placement = placement or Placement.from_env()
        # spare: from the first restart on, keep a standby set of started workers (torch imported,
        # waiting to be connected), so the next restart after a hang or a death costs a rendezvous,
        # not a fresh interpreter per rank
        self.spare = spare
        self._standby: Workers | None = None
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.dir: str | None = None
        self.broken = True
        self.starts = 0
        self.heals = 0
        self.fresh_group = False
        # the groups every rank has made since the last start or reset (harness.ranks.groups): a
        # case whose group is here goes to its own ranks only, the others stay asleep
        self.groups_made: set[tuple] = set()
        self._case_id = 0
        self._finalizer = None
        # what the ranks ran since their last start
        self.history: deque[Ran] = deque(maxlen=HISTORY_MAX)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers, or adopt the standby set, and wait until every one is ready.

        The wait has a deadline. With `spare`, a restart launches the next standby set in the
        background.
        """
        self._release()
        sb = self._standby
        self._standby = None
        if sb is None or sb.size != self.size or any(p.poll() is not None for p in sb.procs):
            if sb is not None:
                sb.finalizer()
            sb = spawn.launch(self, self.size, self.backend, self.placement)
        # the set's finalizer (registered before anything could fail) now belongs to the pool:
        # close(), garbage collection or interpreter exit always kill these workers and remove their
        # dir
        self.dir, self.procs, self._finalizer = sb.dir, sb.procs, sb.finalizer
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for r in range(self.size):
                self.conns.append(spawn.connect(self.dir, self.procs[r], r, sb.authkey, deadline))
            for r, c in enumerate(self.conns):
                while not c.poll(max(0.0, min(interrupt.POLL_S, deadline - time.monotonic()))):
                    if time.monotonic() < deadline:
                        interrupt.check("starting the ranks")
                        continue
                    raise PoolError(
                        f"rank {r} did not finish rendezvous within "
                        f"{START_TIMEOUT_S:.0f} s: "
                        f"{postmortem.log_tail(self.dir, r)}"
                    )
                try:
                    wire.recv(c)
                except EOFError:
                    raise PoolError(
                        f"rank {r} exited during rendezvous: {self._death(r)}"
                    ) from None
        except (PoolError, EOFError, OSError) as e:
            self.close()
            raise PoolError(f"rank pool failed to start: {e}") from None
        self.broken = False
        self.history.clear()
        self.starts += 1
        self.heals = 0
        self.fresh_group = False
        self.groups_made = set()
        # from the first restart on: ranks that hang or die once tend to again,
        if self.spare and self.starts > 1:
            # and a check that never restarts does not pay for idle workers
            self._standby = spawn.launch(self, self.size, self.backend, self.placement)

    def close(self) -> None:
        """Stop every worker and remove the temp dirs. The standby set stops too.

        Each worker is asked politely first, then gets SIGTERM, then SIGKILL.
        """
        # its exit starts now, beside the current set's: both end together
        if self._standby is not None:
            postmortem.signal_groups(self._standby.procs, signal.SIGTERM)
        self._release()
        if self._standby is not None:
            self._standby.finalizer()
            self._standby = None

    def _release(self) -> None:
        """Stop the current workers and remove their dir. The standby set stays."""
        for c in self.conns:
            try:
                wire.send(c, StopMessage(op=STOP))
            except OSError:
                pass
        for c in self.conns:
            c.close()
        self.conns = []
        if self._finalizer is not None:
            self._finalizer()  # kills self.procs, removes self.dir
            self._finalizer = None
        elif self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.procs = []
        self.dir = None
        self.broken = True

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        """The worker processes' pids. Each leads its own session and process group."""
        return [p.pid for p in self.procs]

    def ensure(self, size: int, exact: bool = False) -> bool:
        """Make sure a healthy pool of at least `size` ranks runs. True when it started or
        restarted.

        With `exact`, the pool has exactly `size` ranks: for an implementation whose ring must be
        the whole world.
        """
        fits = self.size == size if exact else self.size >= size
        if not self.broken and fits and all(p.poll() is None for p in self.procs):
            return False
        self.size = size if exact else max(self.size, size)
        self.capacity = max(self.capacity, self.size)
        self.start()
        return True

    # -- running a case --------------------------------------------------------------------
    def run(
        self,
        case: case_mod.Case,
        impl: str | None = None,
        *,
        allow_import: bool = False,
        leak: bool = True,
    ) -> PoolReply:
        """Send the case to every rank and collect replies, within the case's deadline."""
        return self.collect(self.submit(case, impl, allow_import=allow_import, leak=leak))

    def submit(
        self,
        case: case_mod.Case,
        impl: str | None = None,
        *,
        allow_import: bool = False,
        leak: bool = True,
        whole_world: bool = False,
        profile: bool = False,
    ) -> LocalTicket:
        """Send a case to every rank, restarting the pool if needed. The deadline starts now.

        A stop request (harness.interrupt) raises Interrupted here, between cases.
        """
        interrupt.check("before the next case")
        restarted = self.ensure(case.pool_size, exact=whole_world)
        self.history.append(Ran(case, impl or case.impl, leak, allow_import, whole_world))
        self._case_id += 1
        msg = RunMessage(
            op=RUN,
            case=case_mod.to_dict(case),
            impl=impl or case.impl,
            allow_import=allow_import,
            leak=leak,
            profile=profile,
            case_id=self._case_id,
            fresh_group=self.fresh_group and not restarted,
        )
        if msg["fresh_group"]:
            self.groups_made = set()
        self.fresh_group = False
        ranks = self._recipients(case)
        stacks = {r: postmortem.stack_size(self.dir, r) for r in range(self.size)}
        ticket = LocalTicket(
            start=time.monotonic(),
            deadline_s=case.deadline_s,
            pending={},
            dead={},
            case_id=self._case_id,
            stacks=stacks,
            restarted=restarted,
        )
        for r in ranks:
            c = self.conns[r]
            try:
                wire.send(c, msg)
                ticket["pending"][c] = r
            except OSError:
                ticket["dead"][r] = self._death(r)
        return ticket

    def _recipients(self, case: case_mod.Case) -> range:
        """The ranks a case goes to: its ring's, once every rank has made its group; else all.

        `new_group` is collective over the whole pool, so the first case of a group wakes every
        rank. After that, the idle ranks would only parse the case and reply "idle"."""
        from harness.ranks.execute import pg_timeout

        made = groups.key(case.group_offset, case.world_size, pg_timeout(case))
        if made in self.groups_made:
            return range(case.group_offset, case.group_offset + case.world_size)
        self.groups_made.add(made)
        return range(self.size)

    def collect(self, ticket: LocalTicket) -> PoolReply:
        """Wait for every rank's reply until the deadline. Report the hung ranks' stacks and the
        dead ranks.
        """
        out = PoolReply(restarted=ticket["restarted"], dead=dict(ticket["dead"]))
        pending: dict[Connection, int] = ticket["pending"]
        deadline = ticket["start"] + ticket["deadline_s"]
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, min(left, interrupt.POLL_S)))
            if not ready:
                if left <= interrupt.POLL_S:
                    break
                # stop waiting; the ranks are mid-case: restart before any other case
                if interrupt.requested():
                    self.broken = True
                    interrupt.check(f"waiting for {len(pending)} rank(s)")
                continue
            for c in ready:
                r = pending.pop(c)
                try:
                    out.replies[r] = wire.recv(c)
                except (EOFError, OSError):
                    out.dead[r] = self._death(r)
        out.wall_s = time.monotonic() - ticket["start"]
        notes = {r: postmortem.fault_note(self.dir, r, ticket.get("case_id")) for r in out.dead}
        out.notes = {r: n for r, n in notes.items() if n is not None}
        if pending or out.dead:
            self.broken = True
        if any(rep.get("status") not in SETTLED for rep in out.replies.values()):
            # a rank raised mid-ring: its group may hold stale messages. Every rank is alive and
            # idle, so the next case heals by building a fresh group (restart after MAX_HEALS).
            self.heals += 1
            self.fresh_group = True
            if self.heals > MAX_HEALS:
                self.broken = True
        if pending:
            out.hung = postmortem.stacks(
                self.dir, self.procs, sorted(pending.values()), ticket["stacks"]
            )
            # The standby set, if any, stays: the next case adopts it.
            self._release()
        return out

    def oracle(
        self,
        case: case_mod.Case,
        timeout_s: float,
        oracle_pass: OraclePass = "rows",
        stats: tuple | None = None,
    ) -> dict[int, tuple]:
        """One pass of every ring rank's share of the case's oracle (harness.oracle.shares).

        The shares come back over the ranks' own sockets, never a process group. The result maps
        group rank -> (float64 part, base part). A rank that fails, dies or passes `timeout_s`
        raises PoolError, and the pool restarts on the next case.
        """
        msg = OracleMessage(
            op=ORACLE, case=case_mod.to_dict(case), case_id=self._case_id, oracle_pass=oracle_pass
        )
        if stats is not None:
            msg["stats"] = stats
        what = f"the oracle ({oracle_pass} pass) of {case.summary()}"
        pending: dict[Connection, int] = {}
        for r in range(case.group_offset, case.group_offset + case.world_size):
            try:
                wire.send(self.conns[r], msg)
            except OSError:
                self.broken = True
                raise PoolError(f"{what}: rank {r} is gone ({self._death(r)})") from None
            pending[self.conns[r]] = r
        parts: dict[int, tuple] = {}
        end = time.monotonic() + timeout_s
        while pending:
            left = end - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, min(left, interrupt.POLL_S)))
            if not ready and left > interrupt.POLL_S:
                if interrupt.requested():
                    self.broken = True
                    interrupt.check(f"waiting for {what}")
                continue
            if not ready:
                self.broken = True
                raise PoolError(
                    f"{what}: rank(s) {sorted(pending.values())} passed its deadline "
                    f"of {timeout_s:.0f} s"
                )
            for c in ready:
                r = pending.pop(c)
                try:
                    rep = wire.recv(c)
                except (EOFError, OSError):
                    self.broken = True
                    raise PoolError(
                        f"{what}: rank {r} died computing its part ({self._death(r)})"
                    ) from None
                if (
                    rep.get("op") != ORACLE_RESULT
                    or rep.get("case_id") != self._case_id
                    or rep.get("status") != OK
                ):
                    # the other ranks' replies are still on their way: start afresh
                    self.broken = True
                    raise PoolError(
                        f"{what}: rank {r}: "
                        f"{rep.get('error') or 'unexpected reply ' + str(rep.get('op'))}"
                    )
                parts[r - case.group_offset] = rep["parts"]
        return parts

    def _death(self, r: int) -> str:
        """How rank r died and its log's tail (harness.ranks.postmortem)."""
        return postmortem.death(self.dir, r, self.procs[r])
