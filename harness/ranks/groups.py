"""Process groups for the rings of a pool's cases, made the same way on every rank.

`new_group` is collective over the whole pool, so every rank makes every ring's group, in the same
order, whether or not it is a member. The pool worker and the torchrun driver share one `Groups`.
"""

from __future__ import annotations

import datetime


def key(offset: int, size: int, timeout_s: float) -> tuple:
    """A ring's group, as `Groups` caches it and the pool tracks which every rank has made."""
    return (offset, size, round(timeout_s, 3))


class Groups:
    """Process groups for ring subsets, cached by (offset, size, timeout).

    Every rank creates them the same way, because new_group is collective over the whole pool.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.cache: dict[tuple, object] = {}
        # groups that may hold stale messages: kept, never used again
        self.retired: list[object] = []

    def reset(self) -> None:
        """Use fresh groups from now on, after a case whose ranks raised mid-ring.

        The old groups are kept alive, not destroyed: destroying a group with ops in flight can
        block.
        """
        self.retired.extend(self.cache.values())
        self.cache = {}

    def get(self, offset: int, size: int, timeout_s: float):
        import torch.distributed as dist

        name = key(offset, size, timeout_s)
        if name not in self.cache:
            group = dist.new_group(
                ranks=list(range(offset, offset + size)),
                timeout=datetime.timedelta(seconds=timeout_s),
                backend=self.backend,
            )
            # every member has finished building the group before any uses it: without this, a
            # member that returned from new_group, raised at once (e.g. refused the case) and closed
            # its pairs (`_close_peers`) could do so while another member was still connecting them,
            # which then waited forever inside new_group (seen: refusal cases hanging at the
            # deadline on gloo)
            if offset <= dist.get_rank() < offset + size:
                dist.barrier(group=group)
            self.cache[name] = group
        return self.cache[name]
