"""Work balance and stragglers: how evenly a ring spreads the FLOPs, and what one slow rank costs.

Balance is deterministic: the FLOPs each rank computed (harness.ranks.instrument) in one causal
call per declared layout, max over mean. Under a causal mask the contiguous layout gives the last
rank W blocks and the first one, about 2W / (W + 1); zigzag and striped even it out. The straggler
figure is a timing, so it is reported, never judged: one rank made F times slower in compute (the
`straggler` fault), the whole call's slowdown against F.
"""

from __future__ import annotations

from harness.case import Case, make_case
from harness.faults.schema import make_fault
from harness.impls import registry
from harness.impls.capabilities import adapt
from harness.profiling.measure import profile_call
from harness.ranks.protocol import OK, Pool
from harness.runner import submit
from ring_impl.masks import MaskSpec

LAYOUTS = ("contiguous", "zigzag", "striped")
SHAPE = dict(heads_q=2, heads_kv=2, head_dim=32, batch=1, dtype="fp32", seed=7)


def profile_case(impl: str, w: int, tokens: int, layout: str, mask: str) -> Case:
    """The one shape every profiled call uses: an even split of `tokens` a rank, fp32."""
    return make_case(
        world_size=w,
        total_len=tokens * w,
        layout=layout,
        mask=MaskSpec(mask),
        impl=impl,
        **SHAPE,
    )


def work_balance(
    impl: str, pool: Pool, w: int, tokens: int, *, allow_import: bool = False
) -> dict[str, float]:
    """Layout -> max / mean FLOPs over ranks of one causal call (declared layouts only)."""
    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    out = {}
    for layout in LAYOUTS:
        c = adapt(caps, profile_case(impl, w, tokens, layout, "causal"))
        if c is None or c.layout != layout or c.mask.kind != "causal":
            continue
        call = profile_call(c, pool, impl, allow_import=allow_import)
        flops = [sum(e[1] for e in r.events if e[0] == "compute") for r in call.ranks]
        mean = sum(flops) / len(flops)
        out[layout] = max(flops) / mean if mean else 1.0
    return out


def _call_seconds(c: Case, pool: Pool, impl: str, allow_import: bool) -> float:
    """The slowest rank's forward + backward seconds of one plain (unprofiled) call."""
    ticket = submit(pool, c, impl, allow_import=allow_import, leak=False)
    reply = pool.collect(ticket)
    times = [
        m["timings"]["forward_s"] + m["timings"]["backward_s"]
        for m in reply.replies.values()
        if m.get("status") == OK
    ]
    return max(times, default=float("nan"))


def straggler(
    impl: str,
    pool: Pool,
    w: int,
    tokens: int,
    factor: float,
    *,
    repeats: int = 5,
    allow_import: bool = False,
) -> tuple[float, float]:
    """(median plain seconds, median seconds with rank W - 1 `factor` times slower in compute)."""
    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    plain = adapt(caps, profile_case(impl, w, tokens, "contiguous", "none"))
    if plain is None:
        return float("nan"), float("nan")
    slow = plain.replace(faults=(make_fault("straggler", rank=w - 1, factor=factor),))
    base, hit = [], []
    for _ in range(repeats):  # interleaved, so the host's load weighs on both alike
        base.append(_call_seconds(plain, pool, impl, allow_import))
        hit.append(_call_seconds(slow, pool, impl, allow_import))
    return sorted(base)[len(base) // 2], sorted(hit)[len(hit) // 2]
