"""Who computes the oracle, with what deadline and how many threads.

Mode "ranks": each rank of the ring computes its own share after the implementation's run, on its
own device (`oracle_from_ranks`). Mode "local": the parent computes every share while the ranks run
(`harness.oracle.assemble.local`). Both give the same bits on CPU. Mode "auto", the default: for a
small case on CPU ranks the parent computes it, in one pass where it can ("whole",
`harness.oracle.assemble.whole`), else share by share; any other case, ranks (`mode_for`;
docs/benchmarks.md, sections 11 and 14).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from harness.case import Case
from harness.errors import HarnessError
from harness.oracle.assemble import OracleOutputs, two_passes, whole_ok

if TYPE_CHECKING:
    from harness.ranks.protocol import Pool

# who computes the oracle: each rank its own share, or this process
ORACLE_MODES = ("auto", "ranks", "local")
# what `mode_for` resolves to when this process computes it: share by share, or in one pass
PARENT_MODES = ("local", "whole")
_ORACLE_MODE = {"mode": "auto"}
# the largest oracle "auto" computes here: batch x q heads x head dim x n^2 (n = 512 at 4 heads of
# 32, or 1024 at 4 heads of 8): at most ~100 ms on one thread in one pass (docs/benchmarks.md,
# sections 11 and 15)
SMALL_ORACLE = 2**25
# flop/s a rank reaches at worst: 1/50 of one core's float64 rate here (~1e10): the deadline
ORACLE_FLOPS_FLOOR = 2e8
ORACLE_DEADLINE_MIN_S = 120.0
# flops per query x key x head x dim of one pass of a share, float64 and base together, 2 per
# product (harness.oracle.shares): rows, 6 float64 + 7 base products (26), keys, 4 + 4 (16); with
# room for the elementwise work
ORACLE_PASS_FLOPS = {"rows": 32.0, "keys": 20.0}


def current_mode() -> str:
    """The mode the cases run now are judged under: "auto", "ranks" or "local"."""
    return _ORACLE_MODE["mode"]


def small_oracle(case: Case) -> bool:
    """Whether a case's oracle is small enough for "auto" to compute it here."""
    work = case.batch * case.heads_q * max(case.head_dim, case.dim_v) * case.total_len**2
    return work <= SMALL_ORACLE


def ranks_on_cpu(pool: Pool | None) -> bool:
    """Whether a pool's ranks compute on CPU gloo (no pool: assume so)."""
    if pool is None:
        return True
    if pool.backend != "gloo":
        return False
    placement = getattr(pool, "placement", None)
    if placement is not None:
        return placement.device == "cpu"
    return str(getattr(pool, "device", "cpu")) == "cpu"


def mode_for(case: Case, pool: Pool | None = None, mode: str | None = None) -> str:
    """Who computes this case's oracle: "ranks", "local" or "whole", resolving "auto" for the case
    and the pool's device. On a GPU, auto keeps the ranks' oracle. A small case on CPU ranks is
    computed here, in one pass where `whole_ok`."""
    mode = mode or current_mode()
    if mode != "auto":
        return mode
    if not (small_oracle(case) and ranks_on_cpu(pool)):
        return "ranks"
    return "whole" if whole_ok(case) else "local"


@contextlib.contextmanager
def oracle_mode(mode: str) -> Iterator[None]:
    """Run the cases of a block with the oracle computed by `mode` ("auto", "ranks" or "local")."""
    if mode not in ORACLE_MODES:
        raise HarnessError(f"unknown oracle {mode!r}; expected one of {', '.join(ORACLE_MODES)}")
    saved = _ORACLE_MODE["mode"]
    _ORACLE_MODE["mode"] = mode
    try:
        yield
    finally:
        _ORACLE_MODE["mode"] = saved


def oracle_deadline(case: Case, oracle_pass: str = "rows") -> float:
    """Seconds the ranks get for one pass of their oracle shares.

    The pass's float64 and base work for the largest share, its positions against every position,
    at ORACLE_FLOPS_FLOOR, never under ORACLE_DEADLINE_MIN_S. The wider of the two head dims counts
    for every product."""
    local = max(case.seq_lens) if case.seq_lens else 0
    flops = (
        ORACLE_PASS_FLOPS[oracle_pass]
        * case.batch
        * case.heads_q
        * max(case.head_dim, case.dim_v)
        * local
        * case.total_len
    )
    return max(ORACLE_DEADLINE_MIN_S, flops / ORACLE_FLOPS_FLOOR)


def oracle_threads(busy_ranks: int) -> int:
    """Torch threads for the parent's oracle and judge: the cores the `busy_ranks` rank processes
    leave, at least 1. More threads than free cores spin-wait (docs/benchmarks.md)."""
    return max(1, (os.cpu_count() or 1) - busy_ranks)


def oracle_from_ranks(case: Case, pool: Pool) -> tuple[OracleOutputs, OracleOutputs, float]:
    """(exact, base, the slowest share's seconds on its rank), computed by the ring's ranks.

    Two passes: rows, then keys with every row's statistics gathered here."""
    return two_passes(
        case.total_len,
        case.world_size,
        case.scale,
        lambda: pool.oracle(case, oracle_deadline(case, "rows"), "rows"),
        lambda stats: pool.oracle(case, oracle_deadline(case, "keys"), "keys", stats),
    )
