"""The oracle: single-device full attention with the explicit mask, forward and backward.

The float64 reference every rank is judged against, and the same attention in the case's own dtype (the
`base` whose error sets the tolerance). The computation is partitioned by the case: share g is the positions
rank g holds, computed in two passes (`harness.ranks.reference`): its query rows against every key (out, lse,
dq and the rows' statistics), then, once every row's statistics are gathered, every query against its keys
(dk, dv). Two ways to run the passes:

- `ranks` (the default, `harness.runner`): each rank computes its own share on its own device after the
  implementation's run, one message per pass, and the pool sends the parts back;
- `local` (`--oracle local`, the tests' referee): this process computes the W shares one after another.

Either way `two_passes` gathers the statistics between the passes and `assemble` puts the parts together
here. Same parts, same tiles: on CPU the two ways give bit-identical references (docs/tolerance.md states the
bound for other devices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harness.case import Case
from harness.ranks import reference as shares_mod
from harness.ranks.reference import KeysPart, RowsPart, RowStats, TermScales

BLOCK: int | None = None  # tile side for `attention`; None: reference.block_size's score budget

__all__ = ["Reference", "TermScales", "attention", "attention_pair", "assemble", "two_passes", "local", "references",
           "store", "cached"]


@dataclass
class Reference:
    """Global out, lse and q/k/v gradients, all in the compute dtype."""

    out: torch.Tensor  # (B, N, Hq, D)
    lse: torch.Tensor  # (B, Hq, N)
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    term_scale: dict[str, dict[str, float]] = field(default_factory=dict)  # tensor -> {rounding class: scale}


def assemble(n: int, scale: float, rows: Sequence[RowsPart], keys: Sequence[KeysPart],
             n_keys: int | None = None) -> Reference:
    """The global reference from the parts of every share of one compute dtype: each rows part's out/lse/dq
    into its rows (n of them), each keys part's dk/dv into its keys (`n_keys`, n unless said); the term
    scales (float64) from all of them."""
    first, kfirst = rows[0], keys[0]
    b, _, hq, d = first.out.shape
    out, dq = first.out.new_zeros(b, n, hq, d), first.dq.new_zeros(b, n, hq, d)
    lse = first.lse.new_zeros(b, hq, n)
    dk = kfirst.dk.new_zeros(b, n if n_keys is None else n_keys, *kfirst.dk.shape[2:])
    dv = torch.zeros_like(dk)
    for p in rows:
        out.index_copy_(1, p.rows, p.out)
        dq.index_copy_(1, p.rows, p.dq)
        lse.index_copy_(2, p.rows, p.lse)
    for p in keys:
        dk.index_copy_(1, p.keys, p.dk)
        dv.index_copy_(1, p.keys, p.dv)
    exact = out.dtype == torch.float64
    return Reference(out, lse, dq, dk, dv, TermScales(rows, keys).scales(scale) if exact else {})


Parts = tuple  # (float64 part, base part) of one share


def two_passes(n: int, world: int, scale: float, run_rows: Callable[[], dict[int, Parts]],
               run_keys: Callable[[tuple[RowStats, RowStats]], dict[int, Parts]]
               ) -> tuple[Reference, Reference, float]:
    """(float64 reference, base, the slowest share's seconds) from the W shares' rows passes (`run_rows`:
    group rank -> (float64, base) RowsPart), every row's statistics gathered here, and their keys passes
    (`run_keys(stats)`: group rank -> (float64, base) KeysPart)."""
    got = run_rows()
    rows = [got[g] for g in range(world)]
    stats = tuple(shares_mod.gather_stats([r[i] for r in rows], n) for i in (0, 1))
    got = run_keys(stats)
    keys = [got[g] for g in range(world)]
    refs = tuple(assemble(n, scale, [r[i] for r in rows], [k[i] for k in keys]) for i in (0, 1))
    seconds = max(sum(p.seconds for p in r) + sum(p.seconds for p in k) for r, k in zip(rows, keys, strict=True))
    return refs[0], refs[1], seconds


def attention_pair(q, k, v, dout, mask, scale: float, dtype: torch.dtype) -> tuple[Reference, Reference]:
    """(float64 reference, base in `dtype`) of full attention of global tensors (rounded to `dtype`), forward and
    backward, every query and key in one share (as many queries as keys, or fewer: the first ones)."""
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    nq, nk, hkv = q.shape[1], k.shape[1], k.shape[2]
    size = BLOCK or shares_mod.block_size(q.shape[0], q.shape[2])

    def fetch(name: str, pos: torch.Tensor) -> torch.Tensor:
        t = tensors[name]
        return t[:, pos.to(t.device)]

    qpos, kpos = torch.arange(nq), torch.arange(nk)
    groups = shares_mod.groups([kpos], size)
    rows = shares_mod.rows_part(fetch, qpos, [g.pos for g in groups], hkv, mask, scale, dtype, size)
    stats = tuple(shares_mod.gather_stats([r], nq) for r in rows)
    qblocks = [qpos[a:z] for a, z in shares_mod._runs(qpos, size)]
    keys = shares_mod.keys_part(fetch, kpos, 0, qblocks, groups, hkv, stats, mask, scale, dtype)
    return tuple(assemble(nq, scale, [rows[i]], [keys[i]], nk) for i in (0, 1))


def attention(q, k, v, dout, mask, scale: float, compute: torch.dtype) -> Reference:
    """One of `attention_pair`: for compute=float64 the float64 reference of the inputs rounded to float32,
    else the base of a case in `compute` (inputs rounded to it)."""
    if compute == torch.float64:
        return attention_pair(q, k, v, dout, mask, scale, torch.float32)[0]
    return attention_pair(q, k, v, dout, mask, scale, compute)[1]


def local(case: Case) -> tuple[Reference, Reference]:
    """(float64 reference, same-dtype base) computed here, share after share (what the ranks compute)."""
    ref, base, _ = two_passes(
        case.total_len, case.world_size, case.scale,
        lambda: {g: shares_mod.share_rows(case, g) for g in range(case.world_size)},
        lambda stats: {g: shares_mod.share_keys(case, g, stats) for g in range(case.world_size)})
    return ref, base


_CACHE: dict[str, tuple[Reference, Reference]] = {}
_CACHE_MAX = 8


def _key(case: Case) -> str:
    return case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key()


def cached(case: Case) -> bool:
    """Whether the case's references are already known (no need to compute them again)."""
    return _key(case) in _CACHE


def store(case: Case, refs: tuple[Reference, Reference]) -> None:
    """Remember a case's (reference, base), e.g. assembled from the ranks' shares."""
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[_key(case)] = refs


def forget(case: Case) -> None:
    """Drop a case's cached references (a large case's are gigabytes once judged)."""
    _CACHE.pop(_key(case), None)


def references(case: Case) -> tuple[Reference, Reference]:
    """(float64 reference, same-dtype base) for a case: the ranks' assembled shares when `store`d,
    else computed here (`local`); cached because shrinking and replays re-run the same inputs under
    other implementations or faults."""
    key = _key(case)
    if key not in _CACHE:
        store(case, local(case))
    return _CACHE[key]
