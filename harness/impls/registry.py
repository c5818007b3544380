"""Resolve an implementation name to an `Impl`: built-ins, entry points, or `package.module:attr`.

Built-ins are "module:factory" strings imported only when asked for, so importing the registry
imports no third-party library. Installed packages add names through the entry-point group
`ring_harness.impls`. An explicit `package.module:attr` imports arbitrary code, so it is accepted
only with `allow_import=True` (the command line); a case file may only *name* an implementation.
`mutant:NAME` names a bug variant of the reference ring (ring_impl.mutants, for `ring-harness
selftest` and the regression corpus): ours, so no import permission is needed, but never a default
and never listed among the built-ins.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import re
from typing import Any

from harness.context import Capabilities, Impl
from harness.errors import HarnessError
from harness.impls.adapters.reference import MUTANT_PREFIX  # ring_impl.mutants: resolved without an import permission

ENTRY_POINT_GROUP = "ring_harness.impls"

_A = "harness.impls.adapters."
BUILTINS: dict[str, str] = {
    "reference": _A + "reference:impl",
    "ring-attention-pytorch": _A + "ring_attention_pytorch:impl",
    "torch-ring": _A + "torch_ring:impl_allgather",
    "torch-ring-alltoall": _A + "torch_ring:impl_alltoall",
    "ring-flash-attn": _A + "ring_flash_attn:impl_ring",
    "ring-flash-attn-zigzag": _A + "ring_flash_attn:impl_zigzag",
    "ring-flash-attn-stripe": _A + "ring_flash_attn:impl_stripe",
    "ring-flash-attn-llama3": _A + "ring_flash_attn:impl_llama3",
    "torch-cp": _A + "torch_cp:impl_allgather",
    "torch-cp-alltoall": _A + "torch_cp:impl_alltoall",
    "te-cp-p2p": _A + "te_cp:impl_p2p",
    "te-cp-a2a": _A + "te_cp:impl_a2a",
    "te-cp-all-gather": _A + "te_cp:impl_all_gather",
    "yunchang-ring": _A + "yunchang:impl_ring",
    "yunchang-ulysses": _A + "yunchang:impl_ulysses",
    "yunchang-usp": _A + "yunchang:impl_usp",
}

_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class ImplError(HarnessError):
    """An implementation cannot be resolved or cannot run as asked; the message is one line."""


class MissingDependency(ImplError):
    """A built-in adapter's third-party library is not installed (or failed to import)."""


def builtin_names() -> list[str]:
    """Names of the built-in implementations, in listing order (mutants are never among them)."""
    return list(BUILTINS)


def mutant_names() -> list[str]:
    """`mutant:NAME` of every bug variant of the reference ring (selftest's zoo), in zoo order."""
    from harness.impls.adapters.reference import mutant_names as names

    return names()


def entry_point_names() -> list[str]:
    """Names installed packages register under `ring_harness.impls` (built-ins excluded)."""
    return sorted({ep.name for ep in _entry_points()} - set(BUILTINS))


def _entry_points() -> list[md.EntryPoint]:
    try:
        return list(md.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # a broken installed distribution must not break resolving built-ins
        return []


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _import_target(target: str) -> Any:
    """Import `module:attr` (attr may be dotted) and return the object; ImportError propagates."""
    mod_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _as_impl(obj: Any, name: str) -> Impl:
    """An Impl as is; a zero-argument factory is called; a run(q, k, v, ctx) callable is wrapped."""
    if isinstance(obj, Impl):
        return obj
    if callable(obj):
        try:
            params = inspect.signature(obj).parameters.values()
            required = [
                p
                for p in params
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            required = [None] * 4
        if not required:
            made = obj()
            if isinstance(made, Impl):
                return made
            raise ImplError(f"implementation {name!r}: factory returned {type(made).__name__}, not an Impl")
        return Impl(name=name, run=obj, capabilities=Capabilities())
    raise ImplError(f"implementation {name!r} is neither an Impl nor a callable run(q, k, v, ctx)")


def _resolve_builtin(name: str) -> Impl:
    target = BUILTINS[name]
    try:
        module = importlib.import_module(target.partition(":")[0])  # our adapter: imports torch only
    except ImportError as e:
        raise ImplError(f"built-in adapter for {name!r} failed to import: {_one_line(e)}") from None
    try:
        return _as_impl(_import_target(target), name)
    except ImplError:
        raise
    except ImportError as e:
        extra = getattr(module, "EXTRA", None)
        if extra is None:
            raise MissingDependency(f"implementation {name!r} cannot be imported: {_one_line(e)}") from None
        raise MissingDependency(
            f"implementation {name!r} needs the optional extra: "
            f"pip install 'ring-harness[{extra}]' ({_one_line(e)})"
        ) from None


def _resolve_mutant(name: str) -> Impl:
    from harness.impls.adapters.reference import mutant

    try:
        return mutant(name)
    except KeyError:
        known = ", ".join(n.partition(":")[2] for n in mutant_names())
        raise ImplError(f"unknown mutant {name!r}; known: {known}") from None


def _resolve_entry_point(name: str) -> Impl:
    eps = [ep for ep in _entry_points() if ep.name == name]
    try:
        obj = eps[0].load()
    except Exception as e:
        raise ImplError(
            f"implementation {name!r} (entry point {eps[0].value}) failed to load: {_one_line(e)}"
        ) from None
    return _as_impl(obj, name)


def _resolve_module_attr(name: str) -> Impl:
    mod_name, _, attr = name.partition(":")
    try:
        obj = _import_target(name)
    except ImportError as e:
        raise ImplError(f"cannot import {mod_name!r} for implementation {name!r}: {_one_line(e)}") from None
    except AttributeError:
        raise ImplError(f"module {mod_name!r} has no attribute {attr!r} (implementation {name!r})") from None
    return _as_impl(obj, name)


def resolve(name: str, allow_import: bool = True) -> Impl:
    """The Impl for `name`: a built-in, an entry point, or (with allow_import) `package.module:attr`.

    Raises ImplError with a one-line message for unknown names, refused imports and missing
    optional dependencies.
    """
    if not isinstance(name, str) or not name.strip():
        raise ImplError(f"implementation name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in BUILTINS:
        return _resolve_builtin(name)
    if name.startswith(MUTANT_PREFIX):
        return _resolve_mutant(name)
    if any(ep.name == name for ep in _entry_points()):
        return _resolve_entry_point(name)
    if ":" in name:
        if not _MODULE_ATTR.match(name):
            raise ImplError(f"implementation {name!r} is not of the form package.module:attr")
        if not allow_import:
            raise ImplError(
                f"implementation {name!r} is a module path; a case file may only name a built-in or "
                "installed implementation (give module paths on the command line)"
            )
        return _resolve_module_attr(name)
    installed = entry_point_names()
    known = f"built-in: {', '.join(BUILTINS)}" + (f"; installed: {', '.join(installed)}" if installed else "")
    raise ImplError(f"unknown implementation {name!r}; {known}; or give package.module:attr "
                    "(or mutant:NAME for selftest's bug variants)")


def _runnable_backends() -> set[str]:
    import torch
    import torch.distributed as dist

    out = set()
    if dist.is_available() and dist.is_gloo_available():
        out.add("gloo")
    if dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available():
        out.add("nccl")
    return out


def _static_capabilities(name: str) -> Capabilities | None:
    """A built-in adapter's declared capabilities, readable without its third-party library."""
    if name not in BUILTINS:
        return None
    try:
        module = importlib.import_module(BUILTINS[name].partition(":")[0])
    except ImportError:
        return None
    return getattr(module, "CAPABILITIES", {}).get(name)


def describe() -> list[dict]:
    """Rows for `ring-harness impls`: name, source, available (and why not), version, capabilities."""
    here = _runnable_backends()
    rows = []
    names = [(n, "built-in") for n in BUILTINS] + [(n, "entry point") for n in entry_point_names()]
    for name, source in names:
        row: dict[str, Any] = {
            "name": name,
            "source": source,
            "available": False,
            "why": "",
            "version": "-",
            "capabilities": None,
        }
        try:
            impl = resolve(name, allow_import=False)
        except Exception as e:  # describe lists every problem instead of stopping at the first
            caps = _static_capabilities(name)
            row.update(why=_one_line(e), capabilities=caps.to_dict() if caps else None)
            rows.append(row)
            continue
        row.update(version=impl.version, capabilities=impl.capabilities.to_dict())
        backends = set(impl.capabilities.backends)
        if backends & here:
            row["available"] = True
        else:
            need = ", ".join(sorted(backends))
            row["why"] = (
                f"needs backend {need}"
                + (" (CUDA)" if "nccl" in backends else "")
                + f"; here: {', '.join(sorted(here)) or 'none'}"
            )
        rows.append(row)
    return rows
