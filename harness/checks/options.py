"""Options of every check, as dataclasses holding each default once.

The command line builds these, since harness/commands/ is argparse and nothing else. Python callers
build them directly: `harness.check(CheckOptions(impl="mypkg.attn:my_ring", max_examples=50))`.
`validate()` rejects a bad value with one `HarnessError` line naming the option.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from harness import limits, outputs
from harness.dtypes import DTYPES
from harness.errors import HarnessError
from harness.faults.schema import KINDS
from harness.ranks.backend import DEVICES, Placement, placement_of, require_cuda

# Faults that must not change results; the default check runs the first two on every rank, both
# phases.
FAULT_STAGE_KINDS = ("early-read", "send-reuse", "delay", "straggler")
FAULT_STAGE_DEFAULT = ("early-read", "send-reuse")
PROFILES = ("ci", "nightly")  # hypothesis budgets: harness.search.fuzz.PROFILES
LAUNCHERS = ("local", "torchrun")
ORACLES = ("auto", "ranks", "local")  # who computes the float64 oracle (harness.oracle.mode)
BACKENDS = ("gloo", "nccl")
FAULT_BATTERY_PER_KIND = 4


def default(cls: type, name: str):
    """The default of option `name` of an options dataclass, for help texts."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def parse_kinds(
    text: str | tuple[str, ...] | None,
    allowed: tuple[str, ...],
    what: str,
    default_kinds: tuple[str, ...],
    allow_all: bool = False,
) -> tuple[str, ...]:
    """A comma list or tuple of fault kinds -> the kinds in canonical order.

    'none' gives (). 'all' gives every allowed kind, when `allow_all`. Anything else is one clear
    error.
    """
    if text is None:
        return default_kinds
    names = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if allow_all and names == ["all"]:
        return allowed
    if names in ([], ["none"]) and not allow_all:
        return ()
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        if allow_all:
            raise HarnessError(
                f"{what}: unknown fault kind {bad[0] if bad else text!r}; "
                f"expected 'all' or some of {', '.join(allowed)}"
            )
        raise HarnessError(
            f"{what}: {bad[0] if bad else text!r} is not one of "
            f"{', '.join(allowed)} (or none); "
            "drop and crash belong to the --faults battery"
        )
    return tuple(k for k in allowed if k in names)


def _check_common(
    impl: str, world_size: int, deadline: float | None, launcher: str, backend: str | None
) -> None:
    if not isinstance(impl, str) or not impl.strip():
        raise HarnessError(f"impl must be an implementation name, got {impl!r}")
    limits.options({"--world-size": world_size, "--deadline": deadline})
    if launcher not in LAUNCHERS:
        raise HarnessError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    if backend is not None and backend not in BACKENDS:
        raise HarnessError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def _check_placement(device: str | None, launcher: str) -> None:
    if device is None:
        return
    if device not in DEVICES:
        raise HarnessError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and launcher != "local":
        raise HarnessError(
            "--device cuda places the local pool's ranks; "
            "under torchrun each rank takes cuda:LOCAL_RANK"
        )
    if device == "cuda":
        require_cuda("--device cuda")


def _check_share_gpu(share_gpu: bool, launcher: str, backend: str | None) -> None:
    if share_gpu and launcher != "torchrun":
        raise HarnessError(
            "--share-gpu is for ranks torchrun started: add --launcher torchrun "
            "(a local pool shares GPUs with --device cuda)"
        )
    if share_gpu and backend == "gloo":
        raise HarnessError(
            "--share-gpu is for NCCL ranks; for gloo ranks on a GPU, run the local pool "
            "with --device cuda"
        )


def _check_plot(plot: str | None) -> None:
    """--plot: matplotlib importable and the directory writable, before the run, not after it."""
    if plot is None:
        return
    from harness.diagnose.plot import _pyplot

    _pyplot()
    outputs.check_dir(plot, "--plot")


def _check_oracle(oracle: str) -> None:
    if oracle not in ORACLES:
        raise HarnessError(f"--oracle must be one of {', '.join(ORACLES)}, got {oracle!r}")


@dataclass(frozen=True)
class CheckOptions:
    """The default check (`ring-harness check`): fixed battery, fault stage, property-based run."""

    # a built-in name, an installed entry point, or package.module:attr
    impl: str = "reference"
    world_size: int = 4  # main ring size of the battery
    dtype: str | None = None  # run every case in this dtype
    # per-case deadline, seconds (None: each case's own, 60 s)
    deadline: float | None = None
    save_dir: str = "ring-harness-failures"  # failing cases are written here as YAML
    json: str | None = None  # machine-readable results
    # gloo for the local pool; nccl under torchrun when CUDA is available
    backend: str | None = None
    # local: a pool of worker processes; torchrun: the ranks torchrun started
    launcher: str = "local"
    # hypothesis profile: ci (derandomised, fixed budget) or nightly (random, large)
    profile: str = "ci"
    # property-based examples (0: battery only; None: the profile's)
    max_examples: int | None = None
    # seconds of property-based search (None: the profile's)
    time_budget: float | None = None
    # hypothesis seed (None: 0 for ci, random and printed for nightly)
    seed: int | None = None
    # write error heatmaps (PNG) of failing cases here (needs matplotlib)
    plot: str | None = None
    # benign faults on every rank and op, both phases
    fault_stage: tuple[str, ...] = FAULT_STAGE_DEFAULT
    fault_deadline: float = 8.0  # per-case deadline of the fault stage
    # stop after this many failing cases, as pytest's --maxfail (-x: 1)
    maxfail: int | None = None
    # stop after this many hanging cases (each waits out its deadline); 0: no limit
    max_hangs: int = 3
    # run each battery case twice on the same ranks: bit-identical (the "repeat" check)
    repeat: bool = True
    # the growth check: the same global case at W = 1, 2, 4, 8; error must not grow with W
    growth: bool = True
    # the scale stage, and property-based sizes at scale (False: toy sizes only, as before #29)
    scale: bool = True
    # calls, input forms and values of trained models (harness.calls; False: as before #40)
    model_calls: bool = True
    # the attention variants a ring declares: sinks, softcap, ALiBi, a value head dim (False: plain
    # attention only, as before #53)
    variants: bool = True
    # the inference shapes a ring declares: prefill onto a cache, decode (False: training shapes
    # only, as before #54)
    inference: bool = True
    # e.g. "b1,hq32,hkv8,d128,L8192,W8": the basics and the growth check at that shape only
    shape: str | None = None
    # seconds: a --shape plan estimated to take longer is refused up front
    shape_budget: float = 3600.0
    # ranks: each rank computes its query rows' share after its run; local: this process; auto:
    # local for a small case on CPU ranks, else ranks
    oracle: str = "auto"
    # local ranks on cpu, or cuda (the visible GPUs); None: $RING_HARNESS_DEVICE or cpu
    device: str | None = None
    # P2P through host buffers on CPU too, as on cuda (or $RING_HARNESS_STAGE_P2P)
    stage_p2p: bool = False
    # torchrun's NCCL ranks share the visible GPUs, each rank a node of its own to NCCL
    share_gpu: bool = False

    @property
    def allow_import(self) -> bool:
        """A module path may be imported: it came from the caller, not from a case file."""
        from harness.impls.registry import is_module_path

        return is_module_path(self.impl)

    @property
    def placement(self) -> Placement:
        return placement_of(self.device, self.stage_p2p)

    def validate(self) -> CheckOptions:
        _check_common(self.impl, self.world_size, self.deadline, self.launcher, self.backend)
        _check_oracle(self.oracle)
        _check_placement(self.device, self.launcher)
        _check_share_gpu(self.share_gpu, self.launcher, self.backend)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise HarnessError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.profile not in PROFILES:
            raise HarnessError(
                f"--profile must be one of {', '.join(PROFILES)}, got {self.profile!r}"
            )
        limits.options(
            {
                "--max-examples": self.max_examples,
                "--time-budget": self.time_budget,
                "--seed": self.seed,
                "--fault-deadline": self.fault_deadline,
                "--maxfail": self.maxfail,
                "--max-hangs": self.max_hangs,
                "--shape-budget": self.shape_budget,
            }
        )
        parse_kinds(self.fault_stage, FAULT_STAGE_KINDS, "--fault-stage", FAULT_STAGE_DEFAULT)
        if self.shape is not None:
            from harness.checks.shape import parse_shape

            parse_shape(self.shape)
        _check_plot(self.plot)
        outputs.check_file(self.json, "--json")
        outputs.check_dir(self.save_dir, "--save-dir")
        return self

    def with_(self, **changes) -> CheckOptions:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FaultBatteryOptions:
    """The fault battery (`ring-harness check --faults KINDS`): small cases, one fault kind each."""

    impl: str = "reference"
    kinds: tuple[str, ...] = KINDS  # fault kinds, in turn
    cases: int | None = None  # faulted cases (None: FAULT_BATTERY_PER_KIND per kind)
    deadline: float = 8.0  # per-case deadline; drop/crash cases end by it
    seed: int = 0
    world_size: int = 4  # rings of 2..min(world_size, 4) ranks
    save_dir: str = "ring-harness-failures"
    json: str | None = None
    launcher: str = "local"  # the battery kills and restarts ranks: local pool only
    device: str | None = None  # as CheckOptions.device
    stage_p2p: bool = False  # as CheckOptions.stage_p2p

    @property
    def allow_import(self) -> bool:
        from harness.impls.registry import is_module_path

        return is_module_path(self.impl)

    @property
    def placement(self) -> Placement:
        return placement_of(self.device, self.stage_p2p)

    def validate(self) -> FaultBatteryOptions:
        _check_common(self.impl, self.world_size, None, self.launcher, None)
        _check_placement(self.device, self.launcher)
        if self.launcher != "local":
            raise HarnessError(
                "--faults runs on the local pool (it kills and restarts ranks); drop --launcher"
            )
        parse_kinds(self.kinds, KINDS, "--faults", KINDS, allow_all=True)
        limits.options(
            {
                "--fault-cases": self.cases,
                "--fault-deadline": self.deadline,
                "--fault-seed": self.seed,
            }
        )
        outputs.check_file(self.json, "--json")
        outputs.check_dir(self.save_dir, "--save-dir")
        return self


@dataclass(frozen=True)
class ReplayOptions:
    """Replaying one saved case file (`ring-harness replay CASE.yaml`)."""

    case: str = ""  # the case file
    impl: str | None = None  # run under this implementation instead of the case's own
    plot: str | None = None  # heatmaps of a failing replay
    backend: str | None = None
    json: str | None = None
    # ranks: the case's ranks compute the oracle's shares; local: this process does; auto: local
    # for small cases on CPU ranks
    oracle: str = "auto"
    device: str | None = None  # as CheckOptions.device: replay a case on the GPU
    stage_p2p: bool = False  # as CheckOptions.stage_p2p

    @property
    def placement(self) -> Placement:
        return placement_of(self.device, self.stage_p2p)

    def validate(self) -> ReplayOptions:
        if not self.case:
            raise HarnessError("replay needs a case file")
        _check_oracle(self.oracle)
        _check_placement(self.device, "local")
        if self.backend is not None and self.backend not in BACKENDS:
            raise HarnessError(
                f"unknown backend {self.backend!r}; expected one of {', '.join(BACKENDS)}"
            )
        _check_plot(self.plot)
        outputs.check_file(self.json, "--json")
        return self


@dataclass(frozen=True)
class SelftestOptions:
    """`ring-harness selftest`: the default check on every mutant and the reference."""

    # these mutants only (bare names; 'reference' is the control)
    only: tuple[str, ...] | None = None
    # property-based examples for the reference, no time limit
    false_alarm_cases: int | None = None
    save_dir: str = "ring-harness-selftest"  # per-mutant check logs and found cases
    # write each mutant's minimal case here as mutant-NAME.yaml
    corpus: str | None = None
    json: str | None = None
    # what every mutant gets: check's defaults
    check: CheckOptions = field(default_factory=CheckOptions)

    def validate(self) -> SelftestOptions:
        limits.option("--false-alarm-cases", self.false_alarm_cases)
        self.check.validate()
        outputs.check_file(self.json, "--json")
        outputs.check_dir(self.save_dir, "--save-dir")
        outputs.check_dir(self.corpus, "--corpus")
        return self
