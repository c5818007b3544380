"""`ring-harness impls`: the implementations this install knows, whether each can run here, and
what each declares it supports."""

from __future__ import annotations

import argparse
import json

from harness import registry, report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the listing as JSON")


def _caps(c: dict | None) -> str:
    if not c:
        return "-"
    lo, hi = c["world_sizes"]
    parts = ["/".join(c["layouts"]), "/".join(c["masks"]), "/".join(c["dtypes"]), f"W{lo}-{hi}"]
    parts += [p for p, ok in (("gqa", c["gqa"]), ("uneven", c["uneven"]), ("backward", c["backward"]),
                              ("lse", c.get("returns_lse"))) if ok]
    return " ".join(parts) + f" [{'/'.join(c['backends'])}]"


def run(args: argparse.Namespace) -> int:
    rows = registry.describe()
    if args.json:
        report.out(json.dumps(rows, indent=1))
        return 0
    width = max(len(r["name"]) for r in rows)
    vw = max(len(str(r["version"])) for r in rows)
    for r in rows:
        state = "ready" if r["available"] else "unavailable"
        report.out(f"{r['name']:<{width}}  {state:<11}  {r['version']:<{vw}}  {_caps(r['capabilities'])}")
        if r["why"]:
            report.out(f"{'':<{width}}  -> {r['why']}")
    return 0
