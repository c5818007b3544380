"""Tensor checks of one case: every rank's out/lse/dq/dk/dv/dsinks against the float64 oracle.

Three checks per rank and tensor. The error bound is harness.judging.tolerance's rule. The exact
leak check asks whether a masked key changed a result. The precision check (`coarse_grid`) asks
whether a tensor went through a narrower dtype on its way.

The precision check fails a tensor when at least GRID_MIN_VALUES distinct values all lie on a
narrower dtype's grid. A correct fp16 value is a bf16 value with probability 1/8, so 64 of them have
probability ~1e-58. Values below GRID_FLOOR of their terms' scale are not looked at: heavy
cancellation leaves few significant bits. docs/tolerance.md ("The precision check") has the
evidence.
"""

from __future__ import annotations

import itertools
import math

import torch

from harness import inputs
from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.judging import tolerance
from harness.oracle.assemble import OracleOutputs
from harness.result import LeakCheck, TensorCheck
from harness.serving_case import kv_positions, query_positions
from ring_impl.layouts import all_positions
from ring_impl.mask_eval import visible_keys


def _as_bnhd(t: torch.Tensor, name: str) -> torch.Tensor:
    """lse comes as (B, H, L); view it as (B, L, H, 1) so one code path handles every tensor."""
    return t.permute(0, 2, 1).unsqueeze(-1) if name == "lse" else t


def _unravel(flat: int, shape: torch.Size) -> tuple[int, int, int]:
    """(batch, token, head) of a flat index into a (B, L, H, D) tensor."""
    rest, _ = divmod(flat, shape[3])
    rest, hi = divmod(rest, shape[2])
    bi, li = divmod(rest, shape[1])
    return bi, li, hi


GRID_MIN_VALUES = 64
NARROWER = {"fp16": ("bf16",), "fp32": ("bf16", "fp16"), "bf16": ()}  # coarsest first


GRID_FLOOR = 2.0**-6  # values below this fraction of their summed terms' scale are not looked at


def coarse_grid(t: torch.Tensor, dtype: str, floor: float = 0.0) -> tuple[str, int]:
    """(the coarsest dtype narrower than `dtype` on whose grid every normal value of `t` at least
    `floor` in magnitude lies, or '' when there is none or fewer than GRID_MIN_VALUES distinct
    values to tell; the number of distinct values looked at, 0 when on no grid).

    The distinct values are counted only for a grid every value lies on: a correct ring's values
    lie on none, and counting them sorts the tensor."""
    narrower = NARROWER.get(dtype, ())
    if not narrower or t.dtype != TORCH_DTYPES[dtype] or not t.is_floating_point():
        return "", 0
    x = t.reshape(-1)
    x = x[torch.isfinite(x) & (x.abs() >= max(torch.finfo(t.dtype).tiny, floor))]
    for name in narrower:
        if bool((x.to(TORCH_DTYPES[name]).to(t.dtype) == x).all()):
            # distinct values: one value repeated (e.g. every query's output under a uniform
            # softmax) is one sample
            n = torch.unique(x).numel()
            return (name if n >= GRID_MIN_VALUES else ""), n
    return "", 0


def _same_infinity(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where the oracle's value is infinite and the result is the same infinity: the lse = -inf of a
    query that sees no key (README "Rows that see nothing") matched by a result of -inf. An
    implementation with flash-attn's +inf convention for such rows is read as -inf only by its
    adapter, where documented: here +inf against -inf is a wrong value like any other."""
    return torch.isinf(want) & (got == want)


def _diff(got: torch.Tensor, want: torch.Tensor, want_inf: bool = True) -> torch.Tensor:
    """|got - want|, 0 where both are the same infinity (NaN where they are different ones).

    `want_inf=False` says `want` holds no infinity: then no entry is the same infinity, and the
    plain difference is the same tensor, in fewer passes."""
    if not want_inf:
        return (got - want).abs()
    return torch.where(_same_infinity(got, want), torch.zeros_like(want), (got - want).abs())


def _has_inf(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool(torch.isinf(t).any())


def _finite_max(t: torch.Tensor) -> float:
    """max |t| over its finite values (a row that sees nothing has lse -inf; it sets no scale)."""
    if t.numel() == 0:
        return 0.0
    a = t.abs()
    top = a.max()  # NaN or inf when some value is not finite: then only the finite ones count
    if bool(torch.isfinite(top)):
        return float(top)
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


def _kinds(bad: torch.Tensor) -> str:
    """The kinds of non-finite values among `bad`: "NaN", "+inf", "-inf", comma-separated."""
    counts = (("NaN", bad.isnan()), ("+inf", bad == float("inf")), ("-inf", bad == float("-inf")))
    return ",".join(k for k, mask in counts if bool(mask.any()))


def check_tensors(
    case: Case,
    shards: dict[int, dict[str, torch.Tensor]],
    exact: OracleOutputs,
    base: OracleOutputs,
    maps: dict[str, torch.Tensor] | None = None,
) -> list[TensorCheck]:
    """Compare each rank's shards (group rank -> {tensor: shard}) with the oracle's exact outputs.

    With `maps`, also fill maps[tensor] with the (batch, global token, head) max-abs error (inf
    where non-finite), so harness.localise can say where errors concentrate."""
    rows_all, keys_all = query_positions(case), kv_positions(case)
    checks = []
    lse_terms = exact.term_scale.get("lse", {}).get("terms", 0.0)
    lse_max = tolerance.score_units(_finite_max(exact.lse), lse_terms, case.softcap)
    names = [n for n in ("out", "lse", "dq", "dk", "dv") if any(n in s for s in shards.values())]
    for name in names:
        r64 = _as_bnhd(getattr(exact, name), name)
        b = _as_bnhd(getattr(base, name), name).to(torch.float64)
        inf = _has_inf(r64)  # lse of a row that sees nothing; else no tensor has one
        base_err = (
            float(_diff(b, r64, inf).nan_to_num(nan=float("inf")).max()) if r64.numel() else 0.0
        )
        exact_max = _finite_max(r64)
        scales = exact.term_scale
        grid_floor = GRID_FLOOR * max(scales.get(name, {}).values(), default=0.0)
        allowed = tolerance.bound(
            name,
            case.dtype,
            base_err,
            exact_max,
            case.tolerance,
            case.world_size,
            lse_max,
            scales.get(name, 0.0),
            scales.get("blocks", {}).get("max_v", 0.0),
            case.sinks is not None,
        )
        pos_all = keys_all if name in ("dk", "dv") else rows_all
        checks += _rank_checks(case, name, shards, r64, pos_all, allowed, grid_floor, maps, inf)
    return checks + check_dsinks(case, shards, exact, base, lse_max)


def _rank_checks(
    case: Case,
    name: str,
    shards: dict[int, dict[str, torch.Tensor]],
    r64: torch.Tensor,
    pos_all: list[torch.Tensor],
    allowed: float,
    grid_floor: float,
    maps: dict[str, torch.Tensor] | None,
    want_inf: bool = True,
) -> list[TensorCheck]:
    """Every rank's check of tensor `name`. The ranks' shards are compared in one piece, along the
    tokens, and each rank's worst error is read from its slice: a few tensor ops a rank, not a
    dozen (issue #55). `want_inf=False`: the oracle's tensor holds no infinity (`_diff`)."""
    ranks = [r for r, t in sorted(shards.items()) if name in t]
    parts = [_as_bnhd(shards[r][name], name) for r in ranks]
    if not parts:
        return []
    got = torch.cat(parts, 1).to(torch.float64)
    pos = torch.cat([pos_all[r] for r in ranks])
    want = r64.index_select(1, pos)
    bad_values = ~torch.isfinite(got)
    if want_inf:
        bad_values &= ~_same_infinity(got, want)
    diff = _diff(got, want, want_inf).nan_to_num(nan=float("inf"))
    if maps is not None and diff.numel():
        m = maps.setdefault(name, torch.zeros(r64.shape[:3], dtype=torch.float32))
        m[:, pos] = diff.amax(dim=3).float()
    bad_tokens = bad_values.sum(dim=(0, 2, 3)).tolist()
    checks, ends = [], itertools.accumulate(p.shape[1] for p in parts)
    for rank, part, z in zip(ranks, parts, ends, strict=True):
        a = z - part.shape[1]  # this rank's tokens in the joined tensors: a .. z
        d = diff[:, a:z]
        if d.numel() == 0:
            checks.append(TensorCheck(name, rank, 0.0, allowed, 0, {}, True))
            continue
        nonfinite = int(sum(bad_tokens[a:z]))
        bi, li, hi = _unravel(int(d.argmax()), d.shape)  # the first worst, as on a contiguous copy
        err = float(d.max())
        position = {"batch": int(bi), "token": int(pos_all[rank][li]), "head": int(hi)}
        kinds = _kinds(got[:, a:z][bad_values[:, a:z]]) if nonfinite else ""
        grid, looked = (
            ("", 0) if name == "lse" else coarse_grid(shards[rank][name], case.dtype, grid_floor)
        )
        checks.append(
            TensorCheck(
                name,
                rank,
                err,
                allowed,
                nonfinite,
                position,
                passed=nonfinite == 0 and err <= allowed and not grid,
                nonfinite_kinds=kinds,
                grid=grid,
                grid_values=looked if grid else 0,
            )
        )
    return checks


LN2 = math.log(2.0)


def lse_base_slip(
    case: Case, shards: dict[int, dict[str, torch.Tensor]], exact: OracleOutputs, allowed: float
) -> str:
    """Words naming the lse's base when a wrong lse is right in the other one, else "".

    The ranks' lse reached the judge in natural log (a ring declaring base 2 had its lse multiplied
    by ln 2). An lse that matches times ln 2 was log2 where ln was declared (vLLM PR #47079); one
    that matches divided by ln 2 was ln where log2 was declared (SGLang #33064)."""
    rows_all = query_positions(case)
    want_all = _as_bnhd(exact.lse, "lse")
    for factor, words in ((LN2, "log2 where ln"), (1.0 / LN2, "ln where log2")):
        fits = []
        for rank, t in sorted(shards.items()):
            if "lse" not in t:
                continue
            got = _as_bnhd(t["lse"], "lse").to(torch.float64) * factor
            want = want_all.index_select(1, rows_all[rank])
            if got.shape != want.shape:
                return ""
            if got.numel() == 0:  # a rank with no query row says nothing either way
                continue
            fits.append(float(_diff(got, want).nan_to_num(nan=float("inf")).max()) <= allowed)
        if fits and all(fits):
            return f"lse in the wrong base: the ranks returned {words} was declared"
    return ""


def check_dsinks(
    case: Case,
    shards: dict[int, dict[str, torch.Tensor]],
    exact: OracleOutputs,
    base: OracleOutputs,
    lse_max: float,
) -> list[TensorCheck]:
    """The ranks' dsinks (heads_q,), summed, against the oracle's over every row, like dq.

    Which rank holds which rows and heads is the implementation's choice (a ring: its rows,
    Ulysses: its heads). A model's gradient sync sums the ranks' gradients, so the sum is judged
    (docs/case-model.md). It is judged when the case has sinks and the ranks ran a backward (they
    returned dq). A reply without dsinks counts as zeros: what a ring that ignores the sinks
    computes. The check is filed under the ring's first rank.
    """
    if exact.dsinks is None:
        return []
    ranks = {r: t for r, t in shards.items() if "dq" in t or "dsinks" in t}
    if not ranks:
        return []
    want = exact.dsinks.sum(dim=0)
    base_err = float(_diff(base.dsinks.to(torch.float64).sum(dim=0), want).max())
    allowed = tolerance.bound(
        "dsinks",
        case.dtype,
        base_err,
        _finite_max(want),
        case.tolerance,
        case.world_size,
        lse_max,
        exact.term_scale.get("dsinks", 0.0),
        exact.term_scale.get("blocks", {}).get("max_v", 0.0),
        sinks=True,
    )
    got = torch.zeros_like(want)
    for _rank, tensors in sorted(ranks.items()):
        t = tensors.get("dsinks")
        t = torch.zeros_like(want) if t is None else t.detach().to(torch.float64).reshape(-1)
        # the wrong number of heads: wrong everywhere, no value to compare
        got = got + (t if t.shape == want.shape else torch.full_like(want, float("inf")))
    diff = _diff(got, want).nan_to_num(nan=float("inf"))
    bad = ~torch.isfinite(got)
    nonfinite, head = int(bad.sum()), int(diff.argmax())
    check = TensorCheck(
        "dsinks",
        min(ranks),
        float(diff[head]),
        allowed,
        nonfinite,
        {"head": head},
        passed=nonfinite == 0 and float(diff[head]) <= allowed,
        nonfinite_kinds=_kinds(got[bad]) if nonfinite else "",
    )
    return [check]


def check_leak(case: Case, leak_shards: dict[int, dict[str, torch.Tensor]]) -> LeakCheck | None:
    """Exact check: with dout zero outside S, keys invisible to S get dk = dv = 0 exactly."""
    if case.mask.kind == "none" or not leak_shards or case.serving is not None:
        return None
    n = case.total_len
    queries = inputs.leak_queries(case)
    hidden = ~visible_keys(case.mask, queries, n)
    pos_all = all_positions(case.layout, case.seq_lens)
    result = LeakCheck(queries=queries.tolist(), hidden_keys=int(hidden.sum()))
    for rank, t in sorted(leak_shards.items()):
        local_hidden = hidden[pos_all[rank]]
        for name in ("dk", "dv"):
            g = t[name]
            nz = (g != 0).any(dim=3).any(dim=2).any(dim=0)  # per local key token
            bad = (nz & local_hidden).nonzero().view(-1)
            if bad.numel():
                result.leaks.append(
                    {
                        "rank": rank,
                        "tensor": name,
                        "token": int(pos_all[rank][bad[0]]),
                        "count": int(bad.numel()),
                    }
                )
    return result
