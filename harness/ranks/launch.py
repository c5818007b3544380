"""Where the ranks come from: a local pool of worker processes (default), or torchrun's processes.

`open_pool` yields a `Pool` (harness.ranks.protocol: submit/collect/...) on the process that judges,
and None on torchrun's follower ranks once rank 0 has finished (they have nothing to report).
Runs in the parent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from harness.errors import HarnessError
from harness.ranks.backend import Placement
from harness.ranks.protocol import Pool

LAUNCHERS = ("local", "torchrun")


@contextlib.contextmanager
def open_pool(
    launcher: str = "local",
    backend: str | None = None,
    size: int = 4,
    placement: Placement | None = None,
    share_gpu: bool = False,
) -> Iterator[Pool | None]:
    """The ranks for a command: `size` local workers (`local`, on `placement`), or torchrun's
    processes. `share_gpu`: torchrun's NCCL ranks share the visible GPUs (TorchrunPool)."""
    if launcher == "local":
        from harness.ranks.pool import RankPool

        with RankPool(size, backend=backend or "gloo", spare=True, placement=placement) as pool:
            yield pool
        return
    if launcher != "torchrun":
        raise HarnessError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    from harness.ranks.torchrun import TorchrunPool, launched_by_torchrun, torch_threads_for_rank

    if not launched_by_torchrun():
        raise HarnessError(
            "--launcher torchrun needs to be started by torchrun, e.g. "
            "torchrun --nproc-per-node 8 -m harness check --launcher torchrun"
        )
    torch_threads_for_rank()
    pool = TorchrunPool(backend, share_gpu)
    try:
        if pool.rank == 0:
            yield pool
        else:
            pool.follow()
            yield None
    finally:
        pool.close()
