"""`ring-harness profile`: memory class, bytes and messages, overlap, for one ring or several.

Exit 0 when every ring keeps the promises it is judged on, 1 when one breaks one, 2 on bad input.
docs/promises.md walks through a run.
"""

from __future__ import annotations

import argparse

from harness import limits, outputs
from harness.checks import report
from harness.profiling import timeline
from harness.profiling.report import TOKENS_PER_RANK, WORLD_SIZES, profile_ring, table
from harness.ranks.backend import placement_of, require_cuda
from harness.ranks.launch import open_pool
from harness.search.failures import slug  # the command shares one pool across rings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        help="a ring to profile (repeatable; default: reference); package.module:attr imports",
    )
    p.add_argument(
        "--tokens-per-rank",
        type=int,
        default=TOKENS_PER_RANK,
        metavar="N",
        help=f"the length a rank holds at every W (default {TOKENS_PER_RANK})",
    )
    p.add_argument(
        "--max-world-size",
        type=int,
        default=max(WORLD_SIZES),
        choices=WORLD_SIZES,
        help="the largest W to run (default 8)",
    )
    p.add_argument(
        "--straggler",
        type=float,
        default=4.0,
        metavar="F",
        help="time the call with one rank F times slower in compute (default 4; 0: skip)",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="write each ring's timeline here: a Chrome/Perfetto trace JSON and a Gantt PNG",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="where the ranks compute: cpu (gloo), or cuda (W gloo ranks on the visible GPUs, "
        "round-robin, P2P staged through pinned host memory, as `check --device cuda`): peaks from "
        "max_memory_allocated, waits timed with CUDA events (default cpu, or $RING_HARNESS_DEVICE)",
    )
    p.add_argument("--json", metavar="FILE", help="write every ring's figures here")


def run(args: argparse.Namespace) -> int:
    names = args.impl or ["reference"]
    limits.options({"--tokens-per-rank": args.tokens_per_rank, "--straggler": args.straggler})
    outputs.check_file(args.json, "--json")
    outputs.check_dir(args.trace, "--trace")
    placement = placement_of(args.device)
    if placement.device == "cuda":
        require_cuda("--device cuda")
    rings = []
    with open_pool("local", None, args.max_world_size, placement) as pool:
        for name in names:
            ring = profile_ring(
                name,
                pool,
                tokens_per_rank=args.tokens_per_rank,
                allow_import=True,
                straggler=args.straggler,
            )
            rings.append(ring)
            for line in ring.lines():
                report.out(line)
            if args.trace and ring.call is not None:
                for path in timeline.write(ring.call, args.trace, slug(name)):
                    report.out(f"    wrote {path}")
    for line in table(rings):
        report.out(line)
    broken = [r.impl for r in rings if not r.kept]
    if args.json:
        report.write_json(args.json, {"command": "profile", "rings": [r.to_json() for r in rings]})
    if broken:
        report.out(f"profile: {', '.join(broken)} break(s) a promise (exit 1)")
        return 1
    report.out("profile: every ring keeps the promises judged here (exit 0)")
    return 0
