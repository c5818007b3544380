"""`ring-harness check`: the default check (harness.checks.check: growth check, fixed battery,
fault stage, property-based run) against one implementation, or the fault battery with --faults."""

from __future__ import annotations

import argparse

from harness.checks.options import FAULT_STAGE_KINDS, ORACLES, CheckOptions, FaultBatteryOptions
from harness.commands._args import add_placement, build, hint
from harness.dtypes import DTYPES

S = argparse.SUPPRESS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `ring-harness check`, by topic, in the order --help lists them."""
    _add_target(p)
    _add_output(p)
    _add_ranks(p)
    _add_stopping(p)
    _add_stage_switches(p)
    _add_shape(p)
    _add_property_stage(p)
    _add_faults(p)


def _add_target(p: argparse.ArgumentParser) -> None:
    """The implementation, the battery's ring size and the dtype."""
    p.add_argument(
        "--impl",
        default=S,
        help="implementation: a built-in name (see `ring-harness impls`) or "
        "package.module:attr" + hint(CheckOptions, "impl"),
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=S,
        help="main ring size of the battery (which also has W = 1, 2, 3, 8 and a "
        "subgroup; the fault "
        "stage and the property-based run use W up to the pool size)"
        + hint(CheckOptions, "world_size"),
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default=S, help="run every case of every stage in this dtype"
    )


def _add_output(p: argparse.ArgumentParser) -> None:
    """Where results and failing cases are written."""
    p.add_argument("--json", metavar="FILE", default=S, help="write machine-readable results here")
    p.add_argument(
        "--save-dir",
        metavar="DIR",
        default=S,
        help="where failing cases are written as YAML" + hint(CheckOptions, "save_dir"),
    )


def _add_ranks(p: argparse.ArgumentParser) -> None:
    """How the ranks run: the deadline, backend, placement, oracle and launcher."""
    p.add_argument("--deadline", type=float, default=S, metavar="SECONDS", help="per-case deadline")
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=S,
        help="default: gloo for the local pool; nccl under torchrun when CUDA is available",
    )
    add_placement(p)
    p.add_argument(
        "--oracle",
        choices=ORACLES,
        default=S,
        help="who computes the float64 oracle: ranks (each rank its own query rows, "
        "after its run), local (this process, while the ranks run) or auto (this process "
        "for a small case on CPU ranks, in one pass where it can; else ranks)"
        + hint(CheckOptions, "oracle"),
    )
    p.add_argument(
        "--launcher",
        choices=("local", "torchrun"),
        default=S,
        help="local: a pool of worker processes on this host; torchrun: the ranks "
        "torchrun started" + hint(CheckOptions, "launcher"),
    )
    p.add_argument(
        "--share-gpu",
        action="store_true",
        default=S,
        help="under torchrun with NCCL: more ranks than GPUs. Each rank poses as a node of its "
        "own (NCCL_HOSTID) and NCCL links them by sockets on loopback. Correctness only: slow",
    )


def _add_stopping(p: argparse.ArgumentParser) -> None:
    """When the check stops early: failing and hanging cases."""
    p.add_argument(
        "--maxfail",
        type=int,
        default=S,
        metavar="N",
        help="stop after N failing cases (as pytest's --maxfail)",
    )
    p.add_argument(
        "-x",
        "--exitfirst",
        dest="maxfail",
        action="store_const",
        const=1,
        default=S,
        help="stop at the first failing case (--maxfail 1)",
    )
    p.add_argument(
        "--max-hangs",
        type=int,
        default=S,
        metavar="N",
        help="stop after N hanging cases: each waits out --deadline and restarts the "
        "ranks, and a ring "
        "that hangs once usually hangs on every case; 0 runs every case"
        + hint(CheckOptions, "max_hangs"),
    )


def _add_stage_switches(p: argparse.ArgumentParser) -> None:
    """Switches that leave a part of the default check out."""
    p.add_argument(
        "--no-repeat",
        dest="repeat",
        action="store_false",
        default=S,
        help="do not run each battery case a second time on the same ranks (the repeat check)",
    )
    p.add_argument(
        "--no-growth",
        dest="growth",
        action="store_false",
        default=S,
        help="skip the growth check (the same global case at W = 1, 2, 4, 8: the error "
        "must not grow "
        "with the ring size)",
    )
    p.add_argument(
        "--no-scale",
        dest="scale",
        action="store_false",
        default=S,
        help="skip the scale stage and draw property-based cases at toy sizes (<= 64 "
        "tokens, head_dim "
        "<= 32), as the check did before the scale stage",
    )
    p.add_argument(
        "--no-variants",
        dest="variants",
        action="store_false",
        default=S,
        help="plain attention only: no sinks, softcap, ALiBi or value head dim of its own, "
        "even where the ring declares them (the check before #53)",
    )
    p.add_argument(
        "--no-inference",
        dest="inference",
        action="store_false",
        default=S,
        help="training shapes only: no prefill onto a cache or decode, even where the ring "
        "declares them (the check before #54)",
    )
    p.add_argument(
        "--no-model-calls",
        dest="model_calls",
        action="store_false",
        default=S,
        help="only the plain training call on fresh contiguous unit-scale tensors: no "
        "no_grad, "
        "inference_mode or checkpointed calls, no views of a fused QKV, no values "
        "of trained models "
        "(the check before they were added; docs/check.md)",
    )


def _add_shape(p: argparse.ArgumentParser) -> None:
    """The user's own training shape (`--shape`) and its time budget."""
    p.add_argument(
        "--shape",
        metavar="SPEC",
        default=S,
        help="your training shape, e.g. b1,hq32,hkv8,d128,L8192,W8 (batch, query heads, "
        "kv heads, "
        "head_dim, tokens, ranks): run the layout x mask x dtype basics and the "
        "growth check at "
        "exactly that shape, after an estimate of their time and memory here "
        "(refused when it cannot "
        "fit)",
    )
    p.add_argument(
        "--shape-budget",
        type=float,
        default=S,
        metavar="SECONDS",
        help="refuse a --shape whose estimated time exceeds this"
        + hint(CheckOptions, "shape_budget"),
    )


def _add_property_stage(p: argparse.ArgumentParser) -> None:
    """The property-based stage's flags."""
    g = p.add_argument_group("property-based stage")
    g.add_argument(
        "--profile",
        choices=("ci", "nightly"),
        default=S,
        help="hypothesis profile: ci = derandomised, fixed budget; nightly = random, "
        "large budget" + hint(CheckOptions, "profile"),
    )
    g.add_argument(
        "--max-examples",
        type=int,
        default=S,
        metavar="N",
        help="property-based examples (0 = battery only; default: the profile's)",
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=S,
        metavar="SECONDS",
        help="seconds of property-based search (default: the profile's); shrinking a "
        "failure gets more",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=S,
        metavar="S",
        help="hypothesis seed (default: 0 for ci, random and printed for nightly)",
    )
    g.add_argument(
        "--plot",
        default=S,
        metavar="DIR",
        help="write error heatmaps (PNG) of failing cases here (needs matplotlib)",
    )


def _add_faults(p: argparse.ArgumentParser) -> None:
    """The fault stage's and the fault battery's flags."""
    g = p.add_argument_group("fault stage and fault battery")
    g.add_argument(
        "--fault-stage",
        default=S,
        metavar="KINDS",
        help="benign faults the default check runs on every rank in both phases: comma "
        "list of "
        f"{', '.join(FAULT_STAGE_KINDS)}, or none" + hint(CheckOptions, "fault_stage"),
    )
    g.add_argument(
        "--faults",
        metavar="KINDS",
        default=S,
        help="run the fault battery instead: comma list of delay, drop, early-read, "
        "send-reuse, "
        "corrupt, straggler, crash, or 'all'",
    )
    g.add_argument(
        "--fault-cases",
        type=int,
        default=S,
        metavar="N",
        help="faulted cases in the fault battery (default 4 per kind)",
    )
    g.add_argument(
        "--fault-deadline",
        type=float,
        default=S,
        metavar="SECONDS",
        help="per-case deadline of the fault stage and the fault battery"
        + hint(CheckOptions, "fault_deadline"),
    )
    g.add_argument(
        "--fault-seed",
        type=int,
        default=S,
        metavar="N",
        help="seed of the fault battery" + hint(FaultBatteryOptions, "seed"),
    )


def run(args: argparse.Namespace) -> int:
    if hasattr(args, "faults"):
        from harness.checks.fault_battery import fault_battery

        opts = build(
            FaultBatteryOptions,
            args,
            kinds="faults",
            cases="fault_cases",
            deadline="fault_deadline",
            seed="fault_seed",
        )
        return 0 if fault_battery(opts).passed else 1
    from harness.checks.check import check

    if isinstance(getattr(args, "fault_stage", None), str):
        from harness.checks.options import FAULT_STAGE_DEFAULT, parse_kinds

        args.fault_stage = parse_kinds(
            args.fault_stage, FAULT_STAGE_KINDS, "--fault-stage", FAULT_STAGE_DEFAULT
        )
    from harness.interrupt import EXIT_CODES

    res = check(build(CheckOptions, args))
    if res.interrupted:
        return EXIT_CODES.get(res.interrupted, 1)
    return 0 if res.passed else 1
