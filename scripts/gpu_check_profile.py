"""The `profile --device cuda` step of scripts/gpu_check.py: ring attention's promises on the GPU.

Three rings whose verdicts are known on CPU: the reference keeps every promise,
`mutant:all-gather-kv` is O(n) (judged on `max_memory_allocated` here), and
`mutant:wait-before-compute` waits before computing. The step exits 1, naming the two mutants and
no other ring: that is the expected result. CUDA events time each rank's exposed communication.
"""

from __future__ import annotations

from pathlib import Path

from gpu_check_common import Step, cuda_only
from gpu_check_steps import PY

RINGS = ("reference", "mutant:all-gather-kv", "mutant:wait-before-compute")


def profile_command(out: Path) -> list[str]:
    """`ring-harness profile --device cuda` on RINGS at W <= 4: traces and JSON under out/steps."""
    steps = out / "steps"
    rings = [x for name in RINGS for x in ("--impl", name)]
    return [
        PY,
        "-m",
        "harness",
        "profile",
        "--device",
        "cuda",
        *rings,
        "--max-world-size",
        "4",
        "--trace",
        str(steps / "profile-trace"),  # two folders down: the GPU tool returns it
        "--json",
        str(steps / "profile-cuda.json"),
    ]


def profile_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """The one profile step, on one GPU: CUDA only (CI runs the CPU path). `facts` is unused."""
    return [
        Step(
            "profile-cuda",
            "ring-harness profile --device cuda at W = 1, 2, 4 (one GPU, gloo ranks, staged P2P): "
            "memory class from max_memory_allocated, exposed communication per rank and ring "
            "step from CUDA events; expected exit 1 naming mutant:all-gather-kv (O(n)) and "
            "mutant:wait-before-compute (waits before computing), the reference kept",
            profile_command(out),
            150,
            min_s=60,
            skip=cuda_only(device),
            json=str(out / "steps" / "profile-cuda.json"),
            expect=(1,),
        ),
    ]
