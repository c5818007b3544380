"""Install the CPU stand-in for flash-attn's Python API where no real flash-attn is importable.

ring-flash-attn 0.1.8 and yunchang 0.6.4 call flash-attn's CUDA kernels through a few Python
functions of `flash_attn.flash_attn_interface`; their ring logic is plain torch.distributed and runs
on gloo. With `standin/` (a plain folder, no `__init__.py`) first on sys.path, `import flash_attn`
gives ring-harness's CPU stand-in (`standin/flash_attn`, flash-attn 2.8.3's signatures and numerics;
see its docstrings for what each library imports and what is refused), and the libraries run for
real on CPU ranks.

Who calls `install()`: the pool's rank processes (`harness.ranks.worker.serve`), once, when their
backend is gloo (CPU tensors, which no real flash-attn takes). The parent process never installs it:
adapters import their library inside the run, on the ranks. `rank_label(backend)` says, without
installing anything, what a rank on that backend will use (`ring-harness impls` shows it);
`serves_gloo()` whether the stand-in can serve gloo ranks here (no real flash-attn importable),
which the flash-attn adapters use to declare gloo.

Rank processes may also get `standin/` through PYTHONPATH; `install()` then finds the stand-in
already importable and inserts nothing. A real flash-attn is never shadowed: `install()` checks with
`importlib.util.find_spec` first and leaves sys.path alone when one is found.

transformers: ring-flash-attn 0.1.8's package `__init__` imports its HF adapter, which imports
`transformers` at import time. When no real transformers is importable, `install()` also puts
`standin/hf-stub` (a minimal import-time stub, see its docstring) on sys.path, whatever flash-attn
is used.

This module imports the standard library only (no torch, nothing from `harness`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "standin"
HF_STUB_DIR = STANDIN_DIR / "hf-stub"
STANDIN_LABEL = "cpu-standin"


def _find(name: str) -> ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without __spec__
        return None


def _under(spec: ModuleSpec, folder: Path) -> bool:
    """Whether the module `spec` describes lives in `folder`."""
    places = list(spec.submodule_search_locations or []) + ([spec.origin] if spec.origin else [])
    for place in places:
        try:
            if Path(place).resolve().is_relative_to(folder):
                return True
        except (OSError, ValueError):
            continue
    return False


def _prepend(folder: Path) -> None:
    entry = str(folder)
    if entry not in sys.path:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()


def _is_standin_module(name: str) -> bool | None:
    """True/False for an imported module `name` (ours or not); None when it is not imported."""
    module = sys.modules.get(name)
    if module is None:
        return None
    return bool(getattr(module, "__ring_harness_standin__", False))


def install() -> bool:
    """Put `standin/` first on sys.path unless a real flash-attn is importable.

    Returns True when `import flash_attn` now gives the stand-in (also when it already did), False
    when a real flash-attn is (or would be) imported instead. Also installs the transformers stub
    when no real transformers is importable. Idempotent.
    """
    if _find("transformers") is None:
        _prepend(HF_STUB_DIR)
    imported = _is_standin_module("flash_attn")
    if imported is not None:
        return imported
    spec = _find("flash_attn")
    if spec is None:
        _prepend(STANDIN_DIR)
        spec = _find("flash_attn")
    return spec is not None and _under(spec, STANDIN_DIR)


def _real_version() -> str:
    for dist in ("flash-attn", "flash_attn"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        return str(getattr(importlib.import_module("flash_attn"), "__version__", "unknown"))
    except Exception:  # a broken real install: still say what it is
        return "unknown"


def kernel_label() -> str:
    """ "cpu-standin" when `flash_attn` is (or would import as) the stand-in, "flash-attn <version>"
    for a real one, "none" when no flash_attn is importable. Does not import a flash_attn not yet
    imported, unless it is real and its distribution metadata is missing."""
    imported = _is_standin_module("flash_attn")
    if imported:
        return STANDIN_LABEL
    if imported is False:
        return f"flash-attn {getattr(sys.modules['flash_attn'], '__version__', 'unknown')}"
    spec = _find("flash_attn")
    if spec is None:
        return "none"
    if _under(spec, STANDIN_DIR):
        return STANDIN_LABEL
    return f"flash-attn {_real_version()}"


def real_flash_attn() -> bool:
    """Whether a real (not ring-harness's) flash-attn is importable or imported in this process."""
    imported = _is_standin_module("flash_attn")
    if imported is not None:
        return not imported
    spec = _find("flash_attn")
    return spec is not None and not _under(spec, STANDIN_DIR)


def serves_gloo() -> bool:
    """Whether gloo (CPU) ranks here get the stand-in: no real flash-attn is importable (one would
    be used instead, and real flash-attn kernels take CUDA tensors only)."""
    return not real_flash_attn()


def rank_label(backend: str) -> str:
    """The kernel label a rank on `backend` will report, computed without installing anything:
    "flash-attn <version>" for a real one, "cpu-standin" on gloo without one, else "none"."""
    if real_flash_attn():
        return kernel_label()
    return STANDIN_LABEL if backend == "gloo" else "none"
