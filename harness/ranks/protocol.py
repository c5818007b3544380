"""The process protocol, made explicit: the `Pool` interface, every message between the parent
and its ranks, the tickets, and what comes back (`PoolReply`).

Two pools provide `Pool`: `ranks.pool.RankPool` (worker processes on this machine, messages over
Unix sockets) and `ranks.torchrun.TorchrunPool` (torchrun's processes, messages over a gloo
control group). A caller drives either the same way::

    ticket = pool.submit(case, impl)   # every rank starts the case; the deadline starts now
    ...                                # (the parent computes the oracle meanwhile)
    reply = pool.collect(ticket)       # replies, hung ranks' stacks, dead ranks' exit and notes

The conversation with one rank (local pool)::

    parent                         rank
      <------------- ready           (after rendezvous)
      run ------------->
      <------------- result          (one per run, status ok / idle / error / diverged)
      oracle ---------->             (after a run whose ranks all completed, unless cached: pass "rows")
      <------------- oracle-result   (its rows' part of the float64 oracle and the base)
      oracle ---------->             (pass "keys", with every row's statistics)
      <------------- oracle-result   (its keys' part)
      ping ------------>
      <------------- pong
      stop ------------>             (the rank leaves its loop and exits)

Messages are plain dicts (pickled by `ranks.wire`); the TypedDicts below name every key. This
module is imported on both sides, so it imports nothing heavier than the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Literal,
    Protocol,
    TypedDict,
    TypeVar,
    runtime_checkable,
)

if TYPE_CHECKING:
    from harness.case import Case

# -- message kinds (the "op" key) ----------------------------------------------------------------
Op = Literal["run", "stop", "ping", "ready", "pong", "result", "oracle", "oracle-result"]
# the two passes of a rank's oracle share (harness.oracle.shares)
OraclePass = Literal["rows", "keys"]
ORACLE_PASSES: Final = ("rows", "keys")
RUN: Final = "run"  # parent -> rank: run one case
# parent -> rank: compute one pass of your share of a case's oracle (harness.oracle.shares)
ORACLE: Final = "oracle"
STOP: Final = "stop"  # parent -> rank: leave the loop and exit
PING: Final = "ping"  # parent -> rank: are you there?
READY: Final = "ready"  # rank -> parent: rendezvous done, waiting for cases
PONG: Final = "pong"  # rank -> parent: answer to ping
RESULT: Final = "result"  # rank -> parent: one case's outcome on this rank
# rank -> parent: that pass's part of its oracle share (or why not)
ORACLE_RESULT: Final = "oracle-result"

# -- a rank's outcome of one case (the "status" key of a result) -----------------------------------
Status = Literal["ok", "idle", "error", "diverged"]
OK: Final = "ok"  # ran to the end; tensors, hashes and timings are in the reply
IDLE: Final = "idle"  # this rank is outside the case's ring (a smaller ring on a larger pool)
ERROR: Final = "error"  # the implementation raised (a result, not a worker crash)
DIVERGED: Final = "diverged"  # the implementation returned a tensor of the wrong shape
# statuses after which the rank's process groups can be reused as they are
SETTLED: Final = (OK, IDLE)


# -- parent -> rank
# ------------------------------------------------------------------------------------
class _RunRequired(TypedDict):
    op: Literal["run"]
    case: dict[str, Any]  # harness.case.to_dict(case)
    impl: str  # implementation spec, resolved by harness.impls.registry inside the rank
    allow_import: bool  # may the spec be a module:attr import path
    leak: bool  # also run the leak check (a second forward + backward)
    case_id: int  # increases per case; echoed in the result and in the fault note


class RunMessage(_RunRequired, total=False):
    """Run one case on this rank."""

    # build new process groups first (the last case raised mid-ring); local pool only
    fresh_group: bool
    # `ring-harness profile`: log compute between comm ops and the peak memory; no leak run
    profile: bool


class _OracleRequired(TypedDict):
    op: Literal["oracle"]
    case: dict[str, Any]  # harness.case.to_dict(case)
    case_id: int  # echoed in the reply
    # "rows": its query rows against every key; "keys": its keys against every query
    oracle_pass: OraclePass


class OracleMessage(_OracleRequired, total=False):
    """Compute one pass of this rank's share of a case's oracle (outside the fault interposer: no
    fault touches it)."""

    stats: tuple[Any, Any]  # "keys": every row's (float64, base) `harness.oracle.parts.RowStats`


class StopMessage(TypedDict):
    """Leave the serve loop, tear down the process group, exit."""

    op: Literal["stop"]


class PingMessage(TypedDict):
    """Liveness probe; answered with a PongMessage."""

    op: Literal["ping"]


# -- rank -> parent
# ------------------------------------------------------------------------------------
class ReadyMessage(TypedDict):
    """Sent once by a pool worker after rendezvous."""

    op: Literal["ready"]
    rank: int
    pid: int


class PongMessage(TypedDict):
    """The answer to a PingMessage."""

    op: Literal["pong"]
    rank: int


class FaultReport(TypedDict):
    """What the rank's fault interposer saw (harness.faults.interpose.Interposer.report)."""

    fired: dict[int, int]  # fault id -> times it fired
    violations: list[str]  # send buffers modified while their send was in flight
    pending: list[str]  # labels of ops still pending at the end


class _ResultRequired(TypedDict):
    op: Literal["result"]
    rank: int  # global rank
    case_id: int
    status: Status


class ResultMessage(_ResultRequired, total=False):
    """One rank's outcome of one RunMessage. Which keys are present depends on `status`."""

    tensors: dict[str, Any]  # ok: "out", "dq", "dk", "dv" (+ "lse") shards as CPU tensors
    hashes: dict[str, str]  # ok: sha256 prefix of each tensor's bytes
    timings: dict[str, float]  # ok: forward_s, backward_s, inputs_s, pack_s (+ leak_s)
    leak: dict[str, Any]  # ok, masked case without faults: "dk", "dv" of the leak run
    deterministic: bool  # the implementation's own claim (bit-identical reruns)
    error: str  # error / diverged: one line naming the exception and where it came from
    # error / diverged: time.time() when it was raised (orders root cause and consequences)
    error_time: float
    # the flash-attn kernel a flash-attn library ran on ("cpu-standin" or "flash-attn X.Y")
    kernel: str
    traceback: str  # error: the tail of the traceback
    comm: list[list]  # op log, one [kind, peer, bytes, phase, state] per call (not for idle)
    faults: FaultReport  # not for idle
    # profile: "events" (harness.profiling.measure.RankProfile), "start", "peak_bytes"; on CUDA
    # also "cuda_peak_bytes", "cuda_call_ms", "cuda_waits" (harness.ranks.instrument.profiled)
    profile: dict[str, Any]


class _OracleResultRequired(TypedDict):
    op: Literal["oracle-result"]
    rank: int  # global rank
    case_id: int
    status: Status  # ok, idle (outside the case's ring) or error


class OracleResultMessage(_OracleResultRequired, total=False):
    """One pass of one rank's share of the oracle: (float64, base) `harness.oracle.parts.RowsPart`s
    or `KeysPart`s."""

    parts: tuple[Any, Any]  # ok
    error: str  # error: one line (an oracle failure is the harness's, never the implementation's)


Message = (
    RunMessage
    | OracleMessage
    | OracleResultMessage
    | StopMessage
    | PingMessage
    | ReadyMessage
    | PongMessage
    | ResultMessage
)


# -- tickets: what submit() hands back and collect() takes
# -----------------------------------------------
class LocalTicket(TypedDict):
    """RankPool: the case is on its way to every rank; collect() waits on these connections."""

    start: float  # time.monotonic() at submit: the deadline counts from here
    deadline_s: float
    pending: dict[Connection, int]  # connection -> global rank, until its reply arrives
    dead: dict[int, str]  # global rank -> how it died (the send already failed)
    case_id: int
    # global rank -> size of its stack file before the case (read from there)
    stacks: dict[int, int]
    restarted: bool  # submit() (re)started the pool


class TorchrunTicket(TypedDict):
    """TorchrunPool: rank 0 has already run its share; collect() gathers the others'."""

    start: float
    reply: ResultMessage  # rank 0's own result
    dog: Any  # the case's watchdog (torchrun._Watchdog): cancelled once every reply is in


Ticket = LocalTicket | TorchrunTicket
TicketT = TypeVar("TicketT")


@dataclass
class PoolReply:
    """What came back from the ranks of one case."""

    replies: dict[int, ResultMessage] = field(default_factory=dict)  # global rank -> reply
    hung: dict[int, str] = field(default_factory=dict)  # global rank -> stack dump
    dead: dict[int, str] = field(default_factory=dict)  # global rank -> exit status + log tail
    # dead global rank -> the faults it saw fire (its note)
    notes: dict[int, dict] = field(default_factory=dict)
    wall_s: float = 0.0
    restarted: bool = False


@runtime_checkable
class Pool(Protocol[TicketT]):
    """What every pool provides and callers (runner.run_case, the checks, bench, localise, the
    pytest plugin) use. `RankPool` is a `Pool[LocalTicket]`, `TorchrunPool` a
    `Pool[TorchrunTicket]`; callers treat the ticket as opaque and annotate with plain `Pool`."""

    size: int  # ranks running now
    # the largest ring a case can use. A whole-world case restarts a local pool at its own size,
    # so `size` may shrink; the checks plan their cases with `capacity`, which never does.
    capacity: int
    backend: str  # "gloo" or "nccl"
    broken: bool  # the next submit() restarts the ranks (a rank died or hung)
    fresh_group: bool  # the next case runs on fresh process groups (the last one raised mid-ring)

    def submit(
        self,
        case: Case,
        impl: str | None = None,
        *,
        allow_import: bool = False,
        leak: bool = True,
        whole_world: bool = False,
        profile: bool = False,
    ) -> TicketT:
        """Start `case` on every rank (the case's own impl unless `impl`); the deadline starts now.
        `whole_world`: the implementation needs the ring to be every rank of the pool. `profile`:
        each rank also measures the call (harness.ranks.instrument)."""
        ...

    def collect(self, ticket: TicketT) -> PoolReply:
        """Wait (up to the case's deadline) for every rank's reply to the case `ticket` stands
        for."""
        ...

    def oracle(
        self,
        case: Case,
        timeout_s: float,
        oracle_pass: OraclePass = "rows",
        stats: tuple[Any, Any] | None = None,
    ) -> dict[int, tuple[Any, Any]]:
        """One pass of every ring rank's share of `case`'s oracle: group rank -> (float64 part, base
        part) (`harness.oracle.shares`: "rows", then "keys" given every row's `stats`), within
        `timeout_s`; a PoolError when a rank fails, dies or passes it."""
        ...

    def ensure(self, size: int, exact: bool = False) -> bool:
        """Have at least (`exact`: exactly) `size` healthy ranks; True when the ranks were
        (re)started."""
        ...

    def pids(self) -> list[int]:
        """The rank processes' pids (for leftover checks and CPU accounting)."""
        ...

    def close(self) -> None:
        """Stop every rank and release what the pool holds."""
        ...

    def __enter__(self) -> Pool[TicketT]: ...

    def __exit__(self, *exc: object) -> None: ...
