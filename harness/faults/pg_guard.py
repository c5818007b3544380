"""Process groups made inside `run`: refused on the rank, before the real call, so never a hang.

Making a group (new_group, new_subgroups, split_group, a DeviceMesh, a functional collective given
a list of ranks) is collective over the whole world unless it synchronises locally. The pool's other
ranks never make that call, so the ring would wait at the deadline with no word. `guarded` replaces
those calls for one case. A local group of ring ranks only (new_group(ranks,
use_local_synchronization=True)) goes through, named so that its members agree. Anything else
raises ImplError: one line naming the call and what to do instead. Runs inside a rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.distributed.distributed_c10d as c10d

from harness.errors import ImplError

# the words every refusal carries: harness.judging.verdicts.adapter_error reads them
REFUSED = "makes a process group inside run(q, k, v, ctx)"
ADVICE = (
    "every rank of the pool must join that call, and the others never do (it would hang); use "
    "ctx.group (for a mesh: DeviceMesh.from_group(ctx.group, device)), or make the group once and "
    "keep it keyed by ctx.group: at import, or with new_group(ctx.global_ranks, "
    "use_local_synchronization=True)"
)
WORLD_CALLS = ("new_subgroups", "new_subgroups_by_enumeration", "split_group")
_HASH = c10d._hash_ranks_to_str  # how torch names a locally synchronised group


def refusal(call: str) -> ImplError:
    """The one-line error for a group made inside run by `call`."""
    return ImplError(f"{call} {REFUSED}: {ADVICE}")


class _Guard:
    """One case's guard: the ring's global ranks, and the local groups made so far."""

    def __init__(self, ring: Sequence[int], case_id: Any) -> None:
        self.ring = frozenset(ring)
        self.case_id = case_id
        self.made: Counter[tuple[int, ...]] = Counter()
        self.inside = 0  # inside a new_group that went through

    def new_group(self, orig: Callable) -> Callable:
        sig = inspect.signature(orig)

        def new_group(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            ranks = bound.arguments.get("ranks")
            local = bound.arguments.get("use_local_synchronization", False)
            if not (local and ranks and set(ranks) <= self.ring):
                raise refusal(f"torch.distributed.new_group(ranks={ranks})")
            self.inside += 1
            try:
                with self._agreed_name(sorted(ranks)):
                    return orig(*args, **kwargs)
            finally:
                self.inside -= 1

        return new_group

    @contextlib.contextmanager
    def _agreed_name(self, ranks: list[int]) -> Iterator[None]:
        """torch hashes a local group's name with the number of groups this process knows, which
        differs between pool ranks: members would rendezvous apart and hang. Name it by the case
        and the ranks instead, unless the caller already names it (c10d._hash_ranks_to_str)."""
        if c10d._hash_ranks_to_str is not _HASH:
            yield
            return
        key = tuple(ranks)
        self.made[key] += 1
        text = f"ring-harness-local/{self.case_id}/{'_'.join(map(str, key))}/{self.made[key]}"
        name = hashlib.sha1(text.encode()).hexdigest()
        c10d._hash_ranks_to_str = lambda _ranks: name
        try:
            yield
        finally:
            c10d._hash_ranks_to_str = _HASH

    def tagged(self, orig: Callable) -> Callable:
        def _new_group_with_tag(*args: Any, **kwargs: Any) -> Any:
            if not self.inside:
                raise refusal(
                    "a functional collective given a list of ranks (it creates a group: "
                    "c10d._new_group_with_tag)"
                )
            return orig(*args, **kwargs)

        return _new_group_with_tag


def _world_call(name: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise refusal(f"torch.distributed.{name}()")

    return refuse


def _mesh_groups(*args: Any, **kwargs: Any) -> Any:
    """DeviceMesh's group creation (DeviceMesh(...), init_device_mesh, a mesh's _flatten)."""
    frames = {f.name for f in traceback.extract_stack(limit=12)}
    raise refusal("init_device_mesh()" if "init_device_mesh" in frames else "DeviceMesh(...)")


@contextlib.contextmanager
def guarded(ring: Sequence[int], case_id: Any = None) -> Iterator[None]:
    """Refuse, for one case, the group creations the pool's idle ranks would never join."""
    guard = _Guard(ring, case_id)
    fns: dict[str, Callable] = {
        "new_group": guard.new_group(c10d.new_group),
        "_new_group_with_tag": guard.tagged(c10d._new_group_with_tag),
    }
    fns.update({name: _world_call(name) for name in WORLD_CALLS if hasattr(c10d, name)})
    saved = [(m, n, getattr(m, n)) for m in (dist, c10d) for n in fns if hasattr(m, n)]
    mesh_cls = getattr(device_mesh, "DeviceMesh", None)
    mesh_init = None if mesh_cls is None else mesh_cls.__dict__.get("_init_process_groups")
    try:
        for mod, name, _ in saved:
            setattr(mod, name, fns[name])
        if mesh_init is not None:
            mesh_cls._init_process_groups = staticmethod(_mesh_groups)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        if mesh_init is not None:
            mesh_cls._init_process_groups = mesh_init
