"""`ring-harness impls`: the implementations this install knows, whether each can run here, what
each declares it supports, and for the flash-attn libraries the kernel their ranks use here
(`kernel: cpu-standin` where ring-harness's CPU stand-in serves gloo ranks, `kernel: flash-attn X.Y`
for a real one)."""

from __future__ import annotations

import argparse
import json

from harness.checks import report
from harness.impls import registry


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.add_argument(
        "--mutants",
        action="store_true",
        help="also list the bug variants of the reference ring (mutant:NAME, for "
        "`ring-harness selftest`)",
    )


def _caps(c: dict | None) -> str:
    if not c:
        return "-"
    lo, hi = c["world_sizes"]
    parts = ["/".join(c["layouts"]), "/".join(c["masks"]), "/".join(c["dtypes"]), f"W{lo}-{hi}"]
    parts += [
        p
        for p, ok in (
            ("gqa", c["gqa"]),
            ("uneven", c["uneven"]),
            ("backward", c["backward"]),
            ("lse", c.get("returns_lse")),
            ("subgroups", c.get("subgroups", True)),
            ("even-zigzag-chunks", not c.get("zigzag_odd", True)),
            ("heads%W", c.get("heads_divisible_by_world", False)),
            ("idle-ranks", c.get("idle_ranks", False)),
            # the attention variants (harness.context.VARIANTS)
            ("sinks", c.get("sinks", False)),
            ("softcap", c.get("softcap", False)),
            ("alibi", c.get("alibi", False)),
            ("dv", c.get("head_dim_v", False)),
        )
        if ok
    ]
    if c.get("head_dims"):
        parts.append(
            "d" + "/".join(map(str, c["head_dims"]))
            if len(c["head_dims"]) <= 4
            else f"d{min(c['head_dims'])}-{max(c['head_dims'])}"
        )
    return " ".join(parts) + f" [{'/'.join(c['devices'])}]"


def mutant_rows() -> list[dict]:
    """mutant:NAME and the first sentence of its docstring (what bug it reproduces)."""
    from ring_impl.mutants import MUTANTS

    rows = []
    for name in registry.mutant_names():
        doc = " ".join((MUTANTS[name.partition(":")[2]].__doc__ or "").split())
        rows.append({"name": name, "bug": doc.split(". ")[0].rstrip(".")})
    return rows


def run(args: argparse.Namespace) -> int:
    rows = registry.describe()
    mutants = mutant_rows() if args.mutants else []
    if args.json:
        report.out(json.dumps(rows + [{**m, "source": "mutant"} for m in mutants], indent=1))
        return 0
    width = max(len(r["name"]) for r in [*rows, {"name": "implementation"}])
    vw = max(len(str(r["version"])) for r in [*rows, {"version": "version"}])
    report.out(
        f"{'implementation':<{width}}  {'here':<11}  {'version':<{vw}}  declared capabilities [devices]"
    )
    for r in rows:
        state = "ready" if r["available"] else "unavailable"
        kernel = f"  kernel: {r['kernel']}" if r.get("kernel") else ""
        report.out(
            f"{r['name']:<{width}}  {state:<11}  {r['version']:<{vw}}  {_caps(r['capabilities'])}{kernel}"
        )
        if r["why"]:
            report.out(f"{'':<{width}}  -> {r['why']}")
    if mutants:
        report.out("")
        report.out(
            "mutants (bug variants of the reference, never a default; `ring-harness "
            "selftest` runs them):"
        )
        mw = max(len(m["name"]) for m in mutants)
        for m in mutants:
            report.out(f"{m['name']:<{mw}}  {m['bug'][:110]}")
    return 0
