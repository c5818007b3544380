"""Why a rank process died, in words: its exit code or signal, and for SIGKILL the likely cause.

An OOM kill and a kill by hand both arrive as SIGKILL, and a dead rank's memory figures are gone
from /proc. So while the ranks live, a thread of the parent samples their memory and the machine's.
`describe` then weighs that evidence with the kernel log and the memory cgroup, which
harness.ranks.kernel_memory reads. docs/long-sequences.md says why, and in which order. `estimate`
says before a run whether a case fits.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from harness.ranks.kernel_memory import (
    boot_seconds,
    cgroup_oom_kills,
    kernel_log,
    meminfo,
    memory_limit,
    oom_record,
    proc_memory,
)

# how often the watcher reads the ranks' RSS and the machine's free memory
SAMPLE_S = 0.25
# free-memory samples this close to a death count as "just before" it
RECENT_S = 5.0
# MemAvailable under this share of the limit (or under LOW_MEMORY_BYTES): near it
LOW_MEMORY_FRACTION = 0.08
LOW_MEMORY_BYTES = 512 << 20
GIB = float(1 << 30)
# a rank that raised at start can take seconds to exit on a loaded machine (torch teardown)
REAP_WAIT_S = 5.0


@dataclass
class _Rank:
    """What the watcher knows of one rank process."""

    pid: int
    started: float  # time.monotonic() at watch
    oom_kills: int | None  # the cgroup's oom_kill counter at watch
    rss: int = 0  # bytes, last sample
    # bytes, VmHWM at the last sample (the process's own high-water mark)
    peak: int = 0
    # time.monotonic() of the last sample that found it alive (0: never)
    seen: float = 0.0
    # gone for a while (or never seen): no longer sampled, its figures kept
    done: bool = False


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ranks: dict[int, _Rank] = field(default_factory=dict)
    # (t, MemAvailable bytes)
    free: deque = field(default_factory=lambda: deque(maxlen=int(60 / SAMPLE_S)))
    thread: threading.Thread | None = None


_STATE = _State()


# -- the watcher -----------------------------------------------------------------------------------


def watch(proc: subprocess.Popen) -> subprocess.Popen:
    """Sample `proc`'s memory until it dies, and return `proc`.

    The sampler thread starts on the first call.
    """
    st = _STATE
    with st.lock:
        st.ranks[proc.pid] = _Rank(proc.pid, time.monotonic(), cgroup_oom_kills())
        if len(st.ranks) > 4096:  # forget the oldest dead ones
            for pid in [p for p, r in st.ranks.items() if r.done][:1024]:
                st.ranks.pop(pid, None)
        if st.thread is None or not st.thread.is_alive():
            st.thread = threading.Thread(
                target=_sample_forever, daemon=True, name="rank-memory-watch"
            )
            st.thread.start()
    sample_once()
    return proc


def sample_once() -> None:
    """One round: every watched live rank's RSS and high-water mark, and the
    machine's free memory.
    """
    st = _STATE
    now = time.monotonic()
    with st.lock:
        pids = [p for p, r in st.ranks.items() if not r.done]
    for pid in pids:
        mem = proc_memory(pid)
        with st.lock:
            r = st.ranks.get(pid)
            if r is None:
                continue
            if mem is None:
                r.done = now - max(r.seen, r.started) > 30
                continue
            r.rss, r.peak, r.seen = mem[0], max(r.peak, mem[1]), now
    avail = meminfo().get("MemAvailable")
    if avail is not None:
        with st.lock:
            st.free.append((now, avail))


def _sample_forever() -> None:
    while True:
        try:
            sample_once()
        # the watcher must never take the parent down
        except Exception:
            pass
        time.sleep(SAMPLE_S)


def last_seen(pid: int) -> tuple[int, int, float] | None:
    """(last RSS, peak RSS, monotonic time seen alive) of a watched process, or None."""
    with _STATE.lock:
        r = _STATE.ranks.get(pid)
        return None if r is None or not r.seen else (r.rss, r.peak, r.seen)


# -- the words -----------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / (1 << 20):.0f} MiB"


@dataclass
class Evidence:
    """What is known about a SIGKILLed rank. Every field is optional: tests build one by hand."""

    rank: int
    peak: int | None = None  # bytes: the rank's own high-water mark, last sampled
    kernel: str | None = None  # the kernel's OOM-kill message naming the pid
    kernel_readable: bool = False
    cgroup_ooms: int = 0  # OOM kills the cgroup counted since the rank started
    min_free: int | None = None  # least MemAvailable sampled just before the death
    limit: int = 0  # bytes the process tree may use


def evidence(rank: int, pid: int, *, limit: int | None = None) -> Evidence:
    """Gather the evidence on a rank process found dead by SIGKILL."""
    with _STATE.lock:
        r = _STATE.ranks.get(pid)
        rec = (r.peak, r.started, r.oom_kills, r.seen) if r is not None else None
        free = list(_STATE.free)
    ev = Evidence(rank, limit=limit if limit is not None else memory_limit())
    since = None
    if rec is not None:
        peak, started, kills0, seen = rec
        ev.peak = peak or None
        since = boot_seconds() - (time.monotonic() - started) - 1.0
        kills = cgroup_oom_kills()
        if kills is not None and kills0 is not None:
            ev.cgroup_ooms = max(0, kills - kills0)
        end = seen if seen > 0 else time.monotonic()
        near = [a for t, a in free if end - RECENT_S <= t <= end + SAMPLE_S]
        ev.min_free = min(near) if near else None
    records = kernel_log()
    ev.kernel_readable = records is not None
    ev.kernel = oom_record(pid, records, since)
    return ev


def sigkill_cause(ev: Evidence) -> str:
    """The likely cause of a SIGKILL, as one phrase without ';'. The verdict shows what precedes it.

    The evidence counts strongest first: 1. The kernel log names the pid in an OOM kill: out of
    memory. 2. The memory cgroup counted an OOM kill since the rank started: likely out of memory.
    3. Little memory was left just before the death, or the rank held over half the limit: likely
    out of memory. Otherwise the words say the evidence shows no OOM kill.
    """
    at = f"rank {ev.rank} at {_gib(ev.peak)} peak RSS" if ev.peak else f"rank {ev.rank}"
    lim = f"of the {_gib(ev.limit)} limit" if ev.limit and ev.limit < 1 << 61 else ""
    if ev.kernel:
        m = re.search(r"anon-rss:(\d+)kB", ev.kernel)
        anon = f"rank {ev.rank} at {_gib(int(m.group(1)) * 1024)} anonymous RSS" if m else at
        return (
            f"out of memory: {anon} (the kernel's OOM killer: {ev.kernel[:160].replace(';', ',')})"
        )
    low = (
        ev.min_free is not None
        and ev.limit
        and ev.min_free < max(LOW_MEMORY_BYTES, LOW_MEMORY_FRACTION * ev.limit)
    )
    big = ev.peak is not None and ev.limit and ev.peak > 0.5 * ev.limit
    if ev.cgroup_ooms:
        return f"out of memory (likely: the memory cgroup counted {ev.cgroup_ooms} OOM kill(s)): {at} {lim}".strip()
    if low or big:
        why = f"{_gib(ev.min_free)} left on the machine just before" if low else f"over half {lim}"
        return f"likely out of memory: {at} {lim}, {why}".replace("  ", " ")
    log = "no OOM kill in the kernel log" if ev.kernel_readable else "kernel log unreadable"
    free = f", {_gib(ev.min_free)} free just before" if ev.min_free is not None else ""
    return f"not out of memory as far as the evidence shows: {at} {lim}{free}, {log}".replace(
        "  ", " "
    )


def how_it_died(
    rank: int, proc: subprocess.Popen, *, wait_s: float = REAP_WAIT_S, limit: int | None = None
) -> str:
    """'still running', 'exit N' or 'killed by signal N (NAME)', for SIGKILL with its cause."""
    try:
        code = proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return "still running"
    if code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    how = f"killed by signal {-code} ({name})"
    if -code == signal.SIGKILL:
        how += f", {sigkill_cause(evidence(rank, proc.pid, limit=limit))}"
    return how


def describe(rank: int, proc: subprocess.Popen, log_tail: str) -> str:
    """The pool's words for a dead rank: how it died, and why for SIGKILL; then its log's tail."""
    return f"{how_it_died(rank, proc)}; log: {log_tail}"


# -- up front: will a case fit? --------------------------------------------------------------------

# Calibrated on this 2-core 24 GiB host with the tiled reference kernel (issue #21), 32,768 tokens
# W=4 zigzag causal bf16 h4 d64: each rank peaked at 0.82-0.86 GiB (an idle worker holds ~0.26 GiB).
# Per rank: idle worker + bytes per local token per (query head x head_dim) + the tile workspace
# (~24 B per score entry of one tile). The oracle (issue #12), by default computed by the ranks
# after their run (`oracle="ranks"`), in two passes (harness.oracle.shares) whose memory is the
# share's own positions, never the whole sequence at head_dim width: the rows pass holds its rows'
# q/dout/out/dq (+ the float64 term sums) and one block of generated keys, the keys pass its keys'
# k/v/dk/dv (+ the column sums) and one block of generated queries; each holds one tile's workspace
# (harness.oracle.tiles.block: at most SCORE_BUDGET score entries, float64 and float32 temporaries);
# the keys pass also holds every row's statistics (B x Hq floats per token). Its parts are pickled
# while sent. Measured in a fresh process (`ring-harness bench --only oracle_split`, figure (d);
# 2^21-entry tiles): one share's peak above the process at 32,768 tokens, W = 2 / 4 / 8: 289 / 159 /
# 115 MiB (with glibc's default allocator 297 / 213 / 148), up to ~53 B per position x head x dim
# beyond a ~70 MiB workspace (~35 B per score entry); the 32k case end to end (`python
# scripts/long_case.py`): ranks peaked at 0.73-0.82 GiB (the ring's run the larger part), the parent
# at 1.18-1.31 GiB. The parent holds the parts until they are assembled (one set of global tensors:
# they partition the positions), the oracle's outputs and the judging. `oracle="local"`: the parent
# computes every share itself (the same tiles, one share at a time).
RANK_IDLE = 300 << 20
RANK_BYTES_PER_TOKEN_HD = 256  # x local tokens x heads_q x head_dim
TILE_BYTES_PER_SCORE = 24
PARENT_IDLE = 600 << 20
# x total tokens x heads_q x head_dim: exact and base outputs, judging
PARENT_BYTES_PER_TOKEN_HD = 96
# x the share's positions x heads_q x head_dim: a pass's tensors (53 B) and their pickle
SHARE_BYTES_PER_POS_HD = 96
# x total tokens x batch x heads_q: every row's statistics, float64 and base
SHARE_BYTES_PER_TOKEN_H = 96
# x one tile's score entries: float64 and float32 temporaries (q.k, P, dP, dS, s dS)
SHARE_BYTES_PER_SCORE = 48
# x total tokens x heads_q x head_dim: the passes' parts held before assembly
PARENT_BYTES_PER_PART_HD = 32
# below this a case's own bytes fit on any machine the harness runs on, whatever its load
SMALL_WORK = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """The bytes a case is expected to need at its peak: each rank, the parent, all together, and
    what is free.
    """

    per_rank: int
    ranks: int
    parent: int
    available: int
    oracle: str = "ranks"

    @property
    def total(self) -> int:
        return self.per_rank * self.ranks + self.parent

    @property
    def work(self) -> int:
        """The bytes of the case itself: the total less the idle ranks and parent."""
        return self.total - RANK_IDLE * self.ranks - PARENT_IDLE

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def words(self) -> str:
        where = (
            "the ranks compute the oracle, the parent assembles and judges"
            if self.oracle == "ranks"
            else "for the parent's oracle and judging"
        )
        return (
            f"needs ~{_gib(self.total)} ({self.ranks} ranks x {_gib(self.per_rank)} + "
            f"{_gib(self.parent)}; {where}), {_gib(self.available)} available"
        )


def oracle_share_bytes(case) -> int:
    """Peak bytes of computing the largest share of the case's oracle (harness.oracle.shares)."""
    from harness.oracle.tiles import block

    hd = case.heads_q * max(case.head_dim, case.dim_v) * case.batch  # v may be wider (MLA)
    local = max(case.seq_lens) if case.seq_lens else 0
    side = min(block(case), max(local, 1))
    scores = side * min(block(case), case.total_len) * case.heads_q * case.batch
    return (
        SHARE_BYTES_PER_POS_HD * local * hd
        + SHARE_BYTES_PER_TOKEN_H * case.total_len * case.batch * case.heads_q
        + SHARE_BYTES_PER_SCORE * scores
    )


def estimate(
    case, available: int | None = None, tile_budget: int | None = None, oracle: str = "ranks"
) -> MemoryEstimate:
    """Peak memory of running `case`.

    The ranks run a reference-like ring with tiled blocks. With `oracle="ranks"`, each rank then
    computes its oracle share: its peak is the larger of its run and its share. With `"local"`, the
    parent computes every share, one at a time.
    """
    from ring_impl.kernel import tile_scores

    hd = case.heads_q * max(case.head_dim, case.dim_v) * case.batch  # v may be wider (MLA)
    local = max(case.seq_lens) if case.seq_lens else 0
    budget = tile_budget if tile_budget is not None else tile_scores()
    work = min(budget, case.batch * case.heads_q * local * local)
    run = RANK_BYTES_PER_TOKEN_HD * local * hd + TILE_BYTES_PER_SCORE * work
    share = oracle_share_bytes(case)
    n = case.total_len
    parent = PARENT_IDLE + PARENT_BYTES_PER_TOKEN_HD * n * hd
    if oracle == "ranks":
        per_rank = RANK_IDLE + max(run, share)
        parent += PARENT_BYTES_PER_PART_HD * n * hd
    else:
        per_rank = RANK_IDLE + run
        parent += share
    if available is None:
        info = meminfo()
        available = min(info.get("MemAvailable", 1 << 62), memory_limit())
    return MemoryEstimate(per_rank, case.world_size, parent, available, oracle)
