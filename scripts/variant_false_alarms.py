"""Issue #53's false-alarm run of the tolerance rule for each attention variant, without a pool.

The second implementation is a ring simulated on one device with flash arithmetic. Each rank's
queries meet every rank's key block through `ring_impl.kernel` in float32, the variant's scores
from global positions. A block's out and its gradients are rounded to the input dtype (R2), merged
and summed in float32, and cast at the end (R3). The sink is one more merge of (0, sink_h). Two
merges alternate: `ring_impl.merge` and ring-flash-attn's `out - w (out - block_out)`. Each case
is judged by the tolerance rule against the float64 oracle. `--impl NAME` runs an implementation
on four ranks instead, as the check does. docs/tolerance.md has the figures.

    python scripts/variant_false_alarms.py --cases 2000 --seed 53
    python scripts/variant_false_alarms.py --cases 2000 --seed 77 --impl reference
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import inputs  # noqa: E402
from harness.case import Case, make_case  # noqa: E402
from harness.dtypes import TORCH_DTYPES  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.judging.tensor_checks import check_tensors  # noqa: E402
from harness.oracle import assemble  # noqa: E402
from ring_impl import kernel  # noqa: E402
from ring_impl.layouts import all_positions  # noqa: E402
from ring_impl.mask_eval import allowed  # noqa: E402
from ring_impl.merge import merge  # noqa: E402
from ring_impl.variants import Scores, Variant, alibi_slopes, sink_grad, sink_lse  # noqa: E402

VARIANTS = ("softcap", "alibi", "sinks", "head_dim_v", "all")
DTYPES = ("fp32", "fp16", "bf16")
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")
VALUES = ("normal", "normal", "normal", "large", "near-tie", "outliers", "sink")


# -- drawing cases ----------------------------------------------------------------------------


def _mask(rng: random.Random, n: int) -> dict:
    kind = rng.choice(("none", "causal", "causal", "window", "document"))
    if kind == "window":
        return {"kind": "window", "window": rng.randint(0, max(1, n // 2))}
    if kind == "document":
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
        return {"kind": "document", "doc_starts": [0, *cuts], "causal": rng.random() < 0.7}
    return {"kind": kind}


def _sinks(rng: random.Random, heads: int, n: int) -> tuple[float, ...]:
    """Zero, around log N (a row's lse on unit values) and above it, as the strategy draws."""
    pick = rng.choice(("zero", "around", "above", "mixed"))
    if pick == "zero":
        return (0.0,) * heads
    base = torch.log(torch.tensor(float(max(n, 2)))).item()
    lo, hi = {"around": (-1.0, 1.0), "above": (1.0, 6.0), "mixed": (-8.0, 8.0)}[pick]
    return tuple(round(base + rng.uniform(lo, hi), 3) for _ in range(heads))


def draw(rng: random.Random, variant: str) -> Case:
    """One small random case of `variant` (or of all four together)."""
    w = rng.randint(1, 4)
    hkv = rng.randint(1, 3)
    hq = hkv * rng.choice((1, 1, 2, 3))
    d = rng.choice((1, 2, 4, 8, 16, 32, 64))
    lens = tuple(rng.randint(0 if w > 1 else 1, 24) for _ in range(w))
    if sum(lens) == 0:
        lens = (1,) + lens[1:]
    n = sum(lens)
    on = set(VARIANTS[:4]) if variant == "all" else {variant}
    fields = dict(
        world_size=w,
        seq_lens=lens,
        layout=rng.choice(("contiguous", "zigzag", "striped")),
        mask=_mask(rng, n),
        dtype=rng.choice(DTYPES),
        batch=rng.randint(1, 2),
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        values=rng.choice(VALUES),
        seed=rng.randint(0, 2**31),
    )
    if "head_dim_v" in on:
        fields["head_dim_v"] = rng.choice([x for x in (1, 3, 8, 16, 48, 96) if x != d])
    if "softcap" in on:
        fields["softcap"] = rng.choice((0.5, 1.0, 5.0, 20.0, 50.0))
    if "alibi" in on:
        fields["alibi"] = True
    if "sinks" in on:
        fields["sinks"] = _sinks(rng, hq, n)
    return make_case(**fields)


# -- the flash-style ring, simulated ----------------------------------------------------------


def rfa_merge(out, lse, block_out, block_lse):
    """ring-flash-attn's merge: out - sigmoid(block_lse - lse) (out - block_out), in float32."""
    old_empty, new_empty = torch.isneginf(lse), torch.isneginf(block_lse)
    both = old_empty & new_empty
    diff = torch.where(both, torch.zeros_like(lse), block_lse - lse)
    w = torch.where(new_empty, 0.0, torch.where(old_empty, 1.0, torch.sigmoid(diff)))
    out = out - w.transpose(1, 2).unsqueeze(-1) * (out - block_out)
    grown = lse - F.logsigmoid(torch.where(both, torch.zeros_like(lse), lse - block_lse))
    lse = torch.where(new_empty, lse, torch.where(old_empty, block_lse, grown))
    return out, lse


class _NoFactor(Scores):
    """Mutant: softcap's backward without its factor 1 - tanh^2."""

    def factor(self, s: torch.Tensor) -> None:
        return None


# bugs the run must see (--mutant): it is not vacuous
MUTANTS = ("sink-dropped", "sink-twice", "alibi-local", "softcap-no-factor", "dsinks-missing")


def _block(case: Case, variant: Variant, qp: torch.Tensor, kp: torch.Tensor, mutant: str = ""):
    """(mask, score function) of the block of queries qp against keys kp, or None when empty."""
    m = allowed(case.mask, qp, kp)
    if qp.numel() == 0 or kp.numel() == 0 or (m is not None and not bool(m.any())):
        return None
    if mutant == "alibi-local":  # the bias from each rank's local positions
        qp, kp = torch.arange(qp.numel()), torch.arange(kp.numel())
    fn = Scores.of(variant, qp, kp)
    if mutant == "softcap-no-factor" and fn is not None:
        fn = _NoFactor(fn.variant, fn.q_pos, fn.k_pos, fn.slopes)
    return m, fn


def flash_ring(case: Case, rfa: bool, mutant: str = "") -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's out, lse, dq, dk, dv and dsinks from the simulated flash-style ring."""
    dtype, w, scale = TORCH_DTYPES[case.dtype], case.world_size, case.scale
    pos = all_positions(case.layout, case.seq_lens)
    x = {n: [inputs.make(case, n, p) for p in pos] for n in inputs.NAMES}
    slopes = tuple(alibi_slopes(case.heads_q)) if case.alibi else None
    variant = Variant(case.softcap, slopes)
    sinks = None if case.sinks is None else torch.tensor(case.sinks, dtype=torch.float32)
    combine = rfa_merge if rfa else merge
    shards = {g: {} for g in range(w)}
    dk = [torch.zeros(t.shape) for t in x["k"]]
    dv = [torch.zeros(t.shape) for t in x["v"]]
    for g in range(w):
        q, dout = x["q"][g], x["dout"][g]
        b, lq, hq, _ = q.shape
        out = torch.zeros(b, lq, hq, case.dim_v)
        lse = torch.full((b, hq, lq), float("-inf"))
        for step in range(w):
            h = (g - step) % w
            blk = _block(case, variant, pos[g], pos[h], mutant)
            if blk is None:
                continue
            bo, bl = kernel.block_forward(q, x["k"][h], x["v"][h], scale, blk[0], scores=blk[1])
            out, lse = combine(out, lse, bo.to(dtype).float(), bl)  # R2: the block's out
        for _ in range(0 if sinks is None else {"sink-dropped": 0, "sink-twice": 2}.get(mutant, 1)):
            out, lse = combine(out, lse, torch.zeros_like(out), sink_lse(sinks, lse))
        out = out.to(dtype)  # R3
        dq = torch.zeros(q.shape)
        for h in range(w):
            blk = _block(case, variant, pos[g], pos[h], mutant)
            if blk is None:
                continue
            gq, gk, gv = kernel.block_backward(
                dout, q, x["k"][h], x["v"][h], out, lse, scale, blk[0], scores=blk[1]
            )
            dq += gq.to(dtype).float()  # R2: each block's gradients in the input dtype
            dk[h] += gk.to(dtype).float()
            dv[h] += gv.to(dtype).float()
        shards[g].update(out=out, lse=lse, dq=dq.to(dtype))
        if sinks is not None and mutant != "dsinks-missing":
            delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
            shards[g]["dsinks"] = sink_grad(sinks, lse, delta)
    for h in range(w):
        shards[h].update(dk=dk[h].to(dtype), dv=dv[h].to(dtype))
    return shards


# -- the run ----------------------------------------------------------------------------------


# judges one case (its draw index i): (its tensor checks, "" or why its run did not pass)
Judge = Callable[[Case, int], tuple[list, str]]


def simulated(mutant: str = "") -> Judge:
    """The simulated flash-style ring, judged against the local oracle; merges alternate."""

    def judge(case: Case, i: int) -> tuple[list, str]:
        exact, base = assemble.local(case)
        return check_tensors(case, flash_ring(case, i % 2 == 1, mutant), exact, base), ""

    return judge


def on_ranks(impl: str, pool) -> Judge:
    """An implementation run on the pool's ranks, as the check runs a case (`run_case`)."""
    from harness.runner import run_case

    def judge(case: Case, i: int) -> tuple[list, str]:
        r = run_case(case.replace(impl=impl), pool)
        return r.checks, "" if r.passed else f"{r.verdict}: {r.detail}"

    return judge


def run(cases: int, seed: int, variants: tuple[str, ...], judge: Judge) -> tuple[dict, list, dict]:
    """(worst ratio per (variant, dtype, tensor), failures, cases per variant)."""
    worst: dict = defaultdict(float)
    failures, counts = [], defaultdict(int)
    where = run.where = {}  # the case of each worst ratio
    for variant in variants:
        rng = random.Random(f"{seed}-{variant}")
        while counts[variant] < cases:
            try:
                case = draw(rng, variant)
            except HarnessError:
                continue
            checks, why = judge(case, counts[variant])
            for c in checks:
                key = (variant, case.dtype, c.tensor)
                if c.ratio > worst[key]:
                    worst[key], where[key] = c.ratio, case.summary()
                if not c.passed:
                    failures.append((variant, case.summary(), c.tensor, c.rank, c.ratio, c.grid))
            if why and all(c.passed for c in checks):
                failures.append((variant, case.summary(), why))
            counts[variant] += 1
    return worst, failures, counts


def table(worst: dict, variants: tuple[str, ...]) -> str:
    """Markdown: the worst passing ratio per variant, dtype and tensor."""
    lines = ["| variant | dtype | " + " | ".join(TENSORS) + " |", "|---|---|" + "---|" * 6]
    for v in variants:
        for dt in DTYPES:
            cells = [f"{worst[(v, dt, t)]:.3f}" if (v, dt, t) in worst else "-" for t in TENSORS]
            lines.append(f"| {v} | {dt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000, help="cases per variant")
    ap.add_argument("--seed", type=int, default=53)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--mutant", default="", choices=("", *MUTANTS), help="a bug to plant")
    ap.add_argument("--impl", default="", help="run this implementation on 4 ranks instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    variants = tuple(args.variants.split(","))
    t0 = time.perf_counter()
    if args.impl:
        from harness.ranks.pool import RankPool

        with RankPool(4) as pool:
            worst, failures, counts = run(
                args.cases, args.seed, variants, on_ranks(args.impl, pool)
            )
    else:
        worst, failures, counts = run(args.cases, args.seed, variants, simulated(args.mutant))
    print(table(worst, variants))
    total = sum(counts.values())
    failed = len({f[1] for f in failures})
    print(f"\n{total} cases, {failed} failed, {time.perf_counter() - t0:.0f} s")
    for key, ratio in sorted(worst.items(), key=lambda kv: -kv[1])[:5]:
        print("worst", *key, f"x{ratio:.3f}", run.where[key])
    for f in failures[:20]:
        print("FAIL", *f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
