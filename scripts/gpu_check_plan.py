"""The steps of scripts/gpu_check.py: what each runs, its limits, and whether it applies here.

`plan` lists every step for one device in the order they run. Each topic has its own function:
the probe, the reference's cases, torch's CP, the check and selftest, torchrun, DeepSpeed, NCCL.
A step that does not apply carries why in `skip`.
"""

from __future__ import annotations

from pathlib import Path

from gpu_check_common import Step, cuda_only, torchrun_check
from gpu_check_nccl import nccl_steps
from gpu_check_profile import profile_steps
from gpu_check_steps import PY, SCRIPT

ROOT = Path(__file__).resolve().parents[1]


# the cheap and never-run steps first
STEP_ORDER = [
    "nccl-hostid-w2",
    "nccl-hostid-w2-sockets",
    "nccl-hostid-w4",
    "nccl-shared-check-w2",
    "nccl-shared-raise",
    "nccl-shared-hang",
    "nccl-shared-signal",
    "nccl-shared-check-w4",
    "nccl-shared-torch-cp",
    "nccl-shared-faults-delay",
    "nccl-shared-faults-early-read",
    "nccl-shared-faults-send-reuse",
    "profile-cuda",
    "gloo-collectives",
    "reference-cases",
    "torch-cp",
    "torch-cp-alltoall",
    "torch-flex-cp",
    "torch-flex-cp-compiled",
    "long-32k",
    "long-4k",
    "nccl-smoke-w1",
    "torchrun-nccl-w1",
    "torchrun-nccl-multi",
    "nccl-multi-rank-per-gpu",
    "check",
    "selftest-subset",
    "deepspeed-ulysses",
    "deepspeed-ulysses-seqfirst",
    "deepspeed-alst",
    "deepspeed-uneven-length",
    "deepspeed-fpdt",
]


def plan(device: str, out: Path, facts: dict) -> list[Step]:
    """Every step for `device`, in the order they run; the ones that do not apply here carry why."""
    steps = [
        *_probe_steps(device, out),
        *_reference_steps(device, out),
        *_torch_cp_steps(device, out),
        *_check_steps(device, out),
        *_torchrun_steps(device, out, facts),
        *_deepspeed_steps(device, out, facts),
        *nccl_steps(device, out, facts),
        *profile_steps(device, out, facts),
    ]
    return sorted(steps, key=lambda s: STEP_ORDER.index(s.name))


def _json(out: Path, name: str) -> str:
    """Where a step writes its JSON."""
    return str(out / "steps" / f"{name}.json")


def _device_args(device: str) -> list[str]:
    return ["--device", device] + ([] if device == "cuda" else ["--stage-p2p"])


def _check_command(device: str) -> list[str]:
    """The start of a `harness check` command on `device`."""
    return [PY, "-m", "harness", "check", *_device_args(device)]


def _cases(out: Path, device: str, name: str, impl: str, worlds: str, **kw) -> list[str]:
    """The command of a step that runs a few judged cases (`gpu_check.py --cases`)."""
    flags = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return [
        PY,
        str(SCRIPT),
        "--cases",
        impl,
        "--worlds",
        worlds,
        "--device",
        device,
        "--json-out",
        _json(out, name),
        *flags,
    ]


def _probe_steps(device: str, out: Path) -> list[Step]:
    """What gloo does with the device's tensors, op by op."""
    js = _json(out, "gloo-collectives")
    return [
        Step(
            "gloo-collectives",
            "what gloo does with the device's tensors: each P2P op and "
            "collective the rings "
            "use, on two gloo ranks (right, wrong, error, crashed, hung)",
            [PY, str(SCRIPT), "--probe-collectives", "--device", device, "--json-out", js],
            60,
            json=js,
        ),
    ]


def _reference_steps(device: str, out: Path) -> list[Step]:
    """The reference ring's cases at W = 1, 2, 4, 8, and one long case."""
    cuda = device == "cuda"
    return [
        Step(
            "reference-cases",
            "the reference ring at W = 1, 2, 4, 8 (contiguous/zigzag, "
            "none/causal, bf16, "
            "h4 d64, 256 tokens a rank), oracle on the ranks' devices",
            _cases(out, device, "reference-cases", "reference", "1,2,4,8"),
            90,
            json=_json(out, "reference-cases"),
        ),
        Step(
            "long-32k" if cuda else "long-4k",
            "one 32,768-token zigzag causal bf16 case at W = 8, judged with the float64 oracle on "
            "the GPU"
            if cuda
            else "one 4,096-token case at W = 8 (32k on CPU takes too long here), oracle on the "
            "ranks",
            _cases(
                out,
                device,
                "long",
                "reference",
                "8",
                tokens_per_rank=4096 if cuda else 512,
                case_set="long",
            ),
            120,
            min_s=30,
            json=_json(out, "long"),
        ),
    ]


def _torch_cp_steps(device: str, out: Path) -> list[Step]:
    """torch's context_parallel with SDPA and with flex attention: CUDA only."""
    no_cuda = cuda_only(device)
    return [
        Step(
            "torch-cp",
            "torch's context_parallel (SDPA flash/efficient, allgather rotation) at W "
            "= 2, 4 with "
            "backward",
            _cases(out, device, "torch-cp", "torch-cp", "2,4"),
            75,
            skip=no_cuda,
            json=_json(out, "torch-cp"),
        ),
        Step(
            "torch-cp-alltoall",
            "torch's context_parallel, alltoall rotation, at W = 2, 4 with backward",
            _cases(out, device, "torch-cp-alltoall", "torch-cp-alltoall", "2,4"),
            75,
            skip=no_cuda,
            json=_json(out, "torch-cp-alltoall"),
        ),
        Step(
            "torch-flex-cp",
            "flex attention under torch's CP (eager) at W = 2, 4 with backward",
            _cases(out, device, "torch-flex-cp", "torch-flex-cp", "2,4"),
            75,
            skip=no_cuda,
            json=_json(out, "torch-flex-cp"),
        ),
        Step(
            "torch-flex-cp-compiled",
            "flex attention compiled (Triton) under torch's CP at W = 2, 4, backward",
            _cases(out, device, "torch-flex-cp-compiled", "torch-flex-cp-compiled", "2,4"),
            120,
            min_s=40,
            skip=no_cuda,
            json=_json(out, "torch-flex-cp-compiled"),
        ),
    ]


def _check_steps(device: str, out: Path) -> list[Step]:
    """The default check of the reference, and the selftest's fast subset."""
    return [
        Step(
            "check",
            "the default check of the reference at --world-size 8: battery (W = 1, 2, 3, "
            "4, 8), scale "
            "stage, growth check, fault stage (early-read, send-reuse), 10 property-based examples",
            _check_command(device)
            + [
                "--world-size",
                "8",
                "--max-examples",
                "10",
                "--json",
                _json(out, "check"),
                "--save-dir",
                str(out / "failures"),
            ],
            180,
            min_s=60,
            json=_json(out, "check"),
        ),
        Step(
            "selftest-subset",
            "the selftest's fast subset (one mutant per stage) on the device",
            [
                PY,
                "-m",
                "harness",
                "selftest",
                *_device_args(device),
                "--only",
                "naive-merge-sum,out-merge-in-input-dtype,tile-tail-dropped,read-before-wait",
                "--json",
                _json(out, "selftest"),
                "--save-dir",
                str(out / "selftest"),
            ],
            180,
            min_s=60,
            json=_json(out, "selftest"),
        ),
    ]


def _torchrun_check(world_size: int) -> list[str]:
    """The check under torchrun with NCCL at `world_size`: 5 property-based examples, no growth."""
    return torchrun_check(world_size, "--max-examples", "5", "--no-growth")


def _torchrun_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """The check under torchrun with NCCL: at W = 1, and at W = the number of GPUs."""
    no_cuda = cuda_only(device)
    gpus = len(facts.get("gpus") or [])
    return [
        Step(
            "torchrun-nccl-w1",
            "torchrun with NCCL at W = 1: the check's battery on cuda:LOCAL_RANK, oracle there",
            _torchrun_check(1)
            + ["--json", _json(out, "torchrun"), "--save-dir", str(out / "failures-torchrun")],
            120,
            min_s=40,
            skip=no_cuda,
            json=_json(out, "torchrun"),
        ),
        Step(
            "torchrun-nccl-multi",
            "torchrun with NCCL at W = number of GPUs (> 1)",
            _torchrun_check(max(gpus, 2)),
            120,
            min_s=40,
            skip=no_cuda or ("" if gpus >= 2 else f"needs two GPUs; this host has {gpus}"),
        ),
    ]


def _deepspeed_missing(facts: dict) -> str:
    """Why DeepSpeed's steps do not apply ('' when deepspeed imports)."""
    if facts.get("deepspeed"):
        return ""
    return "deepspeed is not importable here (pip install 'ring-harness[deepspeed]')"


def _check_without_faults(device: str, out: Path, impl: str) -> list[str]:
    """The default check of `impl` without the fault stage: 10 property-based examples."""
    return _check_command(device) + [
        "--impl",
        impl,
        "--max-examples",
        "10",
        "--fault-stage",
        "none",
        "--json",
        _json(out, impl),
        "--save-dir",
        str(out / "failures"),
    ]


def _deepspeed_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """DeepSpeed's Ulysses, ALST and FPDT checks, and the corpus case of DeepSpeed #7384."""
    return [
        *_ulysses_steps(device, out, facts),
        _uneven_length_step(device, out, facts),
        _fpdt_step(device, out, facts),
    ]


def _ulysses_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """The default check of each Ulysses variant and of ALST, without the fault stage."""
    ds = _deepspeed_missing(facts)
    hf = ds or (
        ""
        if facts.get("transformers")
        else "transformers is not importable here (ALST's attention)"
    )
    steps = []
    for impl in ("deepspeed-ulysses", "deepspeed-ulysses-seqfirst", "deepspeed-alst"):
        steps.append(
            Step(
                impl,
                f"the default check of {impl} (torch's SDPA on the device) without "
                "the fault stage: "
                "battery, scale stage at training sizes, growth and repeat checks, 10 "
                "property-based "
                "examples",
                _check_without_faults(device, out, impl),
                150,
                min_s=45,
                skip=hf if impl == "deepspeed-alst" else ds,
                json=_json(out, impl),
            )
        )
    return steps


def _uneven_length_step(device: str, out: Path, facts: dict) -> Step:
    """The corpus case of DeepSpeed #7384 (S % W != 0), replayed on the device's tensors."""
    return Step(
        "deepspeed-uneven-length",
        "DeepSpeed #7384 (S % W != 0) on the device's "
        "tensors: the "
        "corpus case that aborts a rank on CPU gloo",
        [
            PY,
            "-m",
            "harness",
            "replay",
            str(ROOT / "cases" / "deepspeed-ulysses-uneven-length.yaml"),
            *_device_args(device),
            "--json",
            _json(out, "deepspeed-uneven-length"),
        ],
        60,
        skip=_deepspeed_missing(facts),
        json=_json(out, "deepspeed-uneven-length"),
    )


def _fpdt_step(device: str, out: Path, facts: dict) -> Step:
    """The default check of deepspeed-fpdt (flash-attn), without the fault stage."""
    cuda = device == "cuda"
    return Step(
        "deepspeed-fpdt",
        "the default check of deepspeed-fpdt (flash-attn) without the fault stage",
        _check_without_faults(device, out, "deepspeed-fpdt")
        # CPU: ci/thirdparty-check.sh's why
        + ([] if cuda else ["--no-scale"]),
        150,
        min_s=45,
        skip=_deepspeed_missing(facts)
        or ("" if facts.get("flash_attn") or not cuda else "needs flash-attn on a GPU host"),
        json=_json(out, "deepspeed-fpdt"),
    )
