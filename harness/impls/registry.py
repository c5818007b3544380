"""Resolve an implementation name: a built-in, an entry point, or `package.module:attr`.

Built-ins come from the adapter modules in ADAPTER_MODULES, in listing order. Listing them or
reading their capabilities imports no third-party library (docs/architecture.md, "an adapter").
Installed packages add names through the entry-point group `ring_harness.impls`.

A `package.module:attr` name imports arbitrary code. So it is accepted only with
`allow_import=True`, as from the command line: a case file may only name an implementation.
`mutant:NAME` names a bug variant of the reference ring (ring_impl.mutants), for selftest and the
regression corpus. It is ours, so it needs no import permission. It is never a default, and never
listed among the built-ins.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.context import Capabilities, Impl
from harness.errors import ImplError, MissingDependency

# ring_impl.mutants: resolved without an import permission
from harness.impls.adapters.reference import MUTANT_PREFIX
from ring_impl.masks import MASK_FEATURES

__all__ = [
    "ADAPTER_MODULES",
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "ImplError",
    "MissingDependency",
    "builtin_names",
    "declared_capabilities",
    "describe",
    "entry_point_names",
    "extra_of",
    "mutant_names",
    "resolve",
]

ENTRY_POINT_GROUP = "ring_harness.impls"
ADAPTER_PACKAGE = "harness.impls.adapters"
# the built-in adapter modules, in listing order; each declares VARIANTS, EXTRA and make(name)
ADAPTER_MODULES = (
    "reference",
    "serving",
    "flash_ring",
    "ring_attention_pytorch",
    "torch_ring",
    "ring_flash_attn",
    "torch_cp",
    "torch_flex_cp",
    "te_cp",
    "yunchang",
    "deepspeed",
    "deepspeed_alst",
    "deepspeed_fpdt",
)

_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def _builtin_modules() -> dict[str, ModuleType]:
    """Built-in name -> its adapter module, from the modules' VARIANTS, in listing order."""
    table: dict[str, ModuleType] = {}
    for short in ADAPTER_MODULES:
        mod_name = f"{ADAPTER_PACKAGE}.{short}"
        try:
            # our adapter: imports torch and the harness only
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ImplError(
                f"built-in adapter module {mod_name!r} failed to import: {_one_line(e)}"
            ) from None
        for name in module.VARIANTS:
            if name in table:
                raise ImplError(
                    f"built-in {name!r} is declared by both {table[name].__name__} and {mod_name}"
                )
            table[name] = module
    return table


class _BuiltinTargets(Mapping[str, str]):
    """A read-only view, built-in name -> "module:make", derived from ADAPTER_MODULES on each
    access.
    """

    def __getitem__(self, name: str) -> str:
        return f"{_builtin_modules()[name].__name__}:make"

    def __iter__(self) -> Iterator[str]:
        return iter(_builtin_modules())

    def __len__(self) -> int:
        return len(_builtin_modules())

    def __repr__(self) -> str:
        return f"BUILTINS({dict(self)!r})"


BUILTINS: Mapping[str, str] = _BuiltinTargets()


def builtin_names() -> list[str]:
    """Names of the built-in implementations, in listing order. Mutants are never among them."""
    return list(_builtin_modules())


def declared_capabilities(name: str) -> Capabilities | None:
    """A built-in's declared capabilities, read without its third-party library.

    None when the name is not a built-in.
    """
    module = _builtin_modules().get(name)
    return None if module is None else module.VARIANTS[name].capabilities


def extra_of(name: str) -> str | None:
    """The optional extra that installs a built-in's library (`ring-harness[EXTRA]`).

    None when it needs none, or is not a built-in. It imports no third-party library.
    """
    module = _builtin_modules().get(name)
    return None if module is None else getattr(module, "EXTRA", None)


def mutant_names() -> list[str]:
    """`mutant:NAME` of every bug variant of the reference ring (selftest's zoo), in zoo order."""
    from harness.impls.adapters.reference import mutant_names as names

    return names()


def entry_point_names() -> list[str]:
    """Names that installed packages register under `ring_harness.impls`, built-ins excluded."""
    return sorted({ep.name for ep in _entry_points()} - set(_builtin_modules()))


def _entry_points() -> list[md.EntryPoint]:
    try:
        return list(md.entry_points(group=ENTRY_POINT_GROUP))
    # A broken installed distribution must not break resolving built-ins.
    except Exception:
        return []


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _did_you_mean(e: BaseException) -> str:
    """' (did you mean 'layouts'?)' for a misspelled keyword of Capabilities or Impl, else ''."""
    import dataclasses
    import difflib
    import re

    m = re.search(
        r"(Capabilities|Impl)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(e)
    )
    if not m:
        return ""
    fields = [
        f.name for f in dataclasses.fields(Capabilities if m.group(1) == "Capabilities" else Impl)
    ]
    close = difflib.get_close_matches(m.group(2), fields, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (its fields: {', '.join(fields)})"


def _import_target(target: str) -> Any:
    """Import `module:attr`, attr maybe dotted, and return the object. ImportError propagates."""
    mod_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _as_impl(obj: Any, name: str) -> Impl:
    """An Impl as it is. A zero-argument factory is called, a run(q, k, v, ctx) callable wrapped."""
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
            try:
                made = obj()
            except ImplError as e:
                raise ImplError(f"implementation {name!r}: {e}") from None
            except Exception as e:
                raise ImplError(
                    f"implementation {name!r}: its factory raised {type(e).__name__}: "
                    f"{_one_line(e)}{_did_you_mean(e)}"
                ) from None
            if isinstance(made, Impl):
                return made
            raise ImplError(
                f"implementation {name!r}: factory returned {type(made).__name__}, not an Impl"
            )
        # a bare run(q, k, v, ctx) declares nothing, so it is taken to support everything (every
        # mask of the mask language, idle ranks): every case runs as supported, none as an
        # undeclared-feature probe
        every = Capabilities(masks=frozenset(MASK_FEATURES), idle_ranks=True)
        return Impl(name=name, run=obj, capabilities=every, declared=False)
    raise ImplError(f"implementation {name!r} is neither an Impl nor a callable run(q, k, v, ctx)")


def _resolve_builtin(name: str, module: ModuleType) -> Impl:
    try:
        impl = module.make(name)
    except ImplError:
        raise
    except ImportError as e:
        extra = getattr(module, "EXTRA", None)
        if extra is None:
            raise MissingDependency(
                f"implementation {name!r} cannot be imported: {_one_line(e)}"
            ) from None
        raise MissingDependency(
            f"implementation {name!r} needs the optional extra: "
            f"pip install 'ring-harness[{extra}]' ({_one_line(e)})"
        ) from None
    if not isinstance(impl, Impl):
        raise ImplError(
            f"implementation {name!r}: factory returned {type(impl).__name__}, not an Impl"
        )
    return impl


def _resolve_mutant(name: str) -> Impl:
    from harness.impls.adapters.reference import mutant

    try:
        return mutant(name)
    except KeyError:
        from harness.impls.adapters.reference import profile_mutant_names

        names = mutant_names() + profile_mutant_names()
        known = ", ".join(n.partition(":")[2] for n in names)
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
    cwd = os.getcwd()
    # As `python -m` does: the modules beside you import.
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        obj = _import_target(name)
    except ImportError as e:
        raise ImplError(
            f"cannot import {mod_name!r} for implementation {name!r}: {_one_line(e)}"
        ) from None
    except AttributeError:
        raise ImplError(
            f"module {mod_name!r} has no attribute {attr!r} (implementation {name!r})"
        ) from None
    # A declaration mistake in Capabilities or Impl, made at import time.
    except ImplError as e:
        raise ImplError(f"implementation {name!r}: {e}") from None
    # the user's module raised while it was imported: their code, not a ring's run
    except Exception as e:
        raise ImplError(
            f"importing {mod_name!r} for implementation {name!r} raised "
            f"{type(e).__name__}: "
            f"{_one_line(e)}{_did_you_mean(e)}"
        ) from None
    return _as_impl(obj, name)


def module_path_of(obj: Any) -> str:
    """The `package.module:attr` name of an Impl or of a run(q, k, v, ctx) function.

    It must be defined at the top level of an importable module, because the ranks are other
    interpreters and import it by that name. The module's import root is put on PYTHONPATH for the
    ranks started from now on. An object without such a name raises one HarnessError line.
    """
    if isinstance(obj, str):
        return obj
    fn = obj.run if isinstance(obj, Impl) else obj
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    what = f"{type(obj).__name__} {getattr(obj, 'name', getattr(obj, '__name__', ''))!r}"
    if mod is None or mod.__name__ == "__main__" or not getattr(mod, "__file__", None):
        raise ImplError(
            f"{what}: the ranks import the implementation, so define it at the top "
            "level of an "
            "importable module (not __main__), or give its name as "
            "'package.module:attr'"
        )
    attr = next((k for k, v in vars(mod).items() if v is obj), None)
    if attr is None:
        raise ImplError(
            f"{what}: not found as a top-level name of {mod.__name__}; the ranks "
            "import the "
            "implementation, so bind it to a module-level name (or give "
            "'package.module:attr')"
        )
    depth = mod.__name__.count(".") + (2 if os.path.basename(mod.__file__) == "__init__.py" else 1)
    root = str(Path(mod.__file__).resolve().parents[depth - 1])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, *paths]))
    return f"{mod.__name__}:{attr}"


def is_module_path(name: str) -> bool:
    """Whether `name` is a `package.module:attr` name, whose resolution imports arbitrary code.

    Only the caller may allow that, never a case file. `mutant:NAME`, built-in and entry-point names
    are not module paths.
    """
    name = name.strip() if isinstance(name, str) else ""
    return ":" in name and not name.startswith(MUTANT_PREFIX) and name not in BUILTINS


def resolve(name: str, allow_import: bool = True) -> Impl:
    """The Impl for `name`: a built-in, an entry point, or `package.module:attr` with allow_import.

    It raises ImplError with one line for an unknown name, a refused import or a missing optional
    dependency.
    """
    if not isinstance(name, str) or not name.strip():
        raise ImplError(f"implementation name must be a non-empty string, got {name!r}")
    name = name.strip()
    builtins = _builtin_modules()
    if name in builtins:
        return _resolve_builtin(name, builtins[name])
    if name.startswith(MUTANT_PREFIX):
        return _resolve_mutant(name)
    if any(ep.name == name for ep in _entry_points()):
        return _resolve_entry_point(name)
    if ":" in name:
        if not _MODULE_ATTR.match(name):
            raise ImplError(f"implementation {name!r} is not of the form package.module:attr")
        if not allow_import:
            raise ImplError(
                f"implementation {name!r} is a module path; a case file may only name a built-in "
                "or "
                "installed implementation (give module paths on the command line)"
            )
        return _resolve_module_attr(name)
    installed = entry_point_names()
    known = f"built-in: {', '.join(builtins)}" + (
        f"; installed: {', '.join(installed)}" if installed else ""
    )
    raise ImplError(
        f"unknown implementation {name!r}; {known}; or give package.module:attr "
        "(or mutant:NAME for selftest's bug variants)"
    )


def _runnable_devices() -> set[str]:
    """The devices ranks can hold tensors on here: cpu with gloo, cuda with NCCL and a GPU."""
    import torch
    import torch.distributed as dist

    out = set()
    if dist.is_available() and dist.is_gloo_available():
        out.add("cpu")
    if dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available():
        out.add("cuda")
    return out


def _kernel(name: str, devices: set[str], here: set[str]) -> str | None:
    """The flash-attn kernel that a built-in declaring `KERNEL` gets on this machine's ranks.

    It is "cpu-standin" on gloo without a real flash-attn, a version such as "flash-attn 2.8.3", or
    "none". None for the other built-ins.
    """
    module = _builtin_modules().get(name)
    if module is None or getattr(module, "KERNEL", None) is None:
        return None
    from harness.kernels import flash_standin

    return flash_standin.rank_label("gloo" if "cpu" in devices & here else "nccl")


def describe() -> list[dict]:
    """The rows of `ring-harness impls`.

    Each row has the name, source, availability (and why not), version and capabilities. Adapters of
    flash-attn libraries add the kernel their ranks use here (`kernel`).
    """
    here = _runnable_devices()
    rows = []
    names = [(n, "built-in") for n in builtin_names()] + [
        (n, "entry point") for n in entry_point_names()
    ]
    for name, source in names:
        row: dict[str, Any] = {
            "name": name,
            "source": source,
            "available": False,
            "why": "",
            "version": "-",
            "capabilities": None,
        }
        caps = declared_capabilities(name)
        kernel = _kernel(name, set(caps.devices) if caps else set(), here)
        if kernel is not None:
            row["kernel"] = kernel
        try:
            impl = resolve(name, allow_import=False)
        # describe lists every problem instead of stopping at the first.
        except Exception as e:
            caps = declared_capabilities(name)
            row.update(why=_one_line(e), capabilities=caps.to_dict() if caps else None)
            rows.append(row)
            continue
        row.update(version=impl.version, capabilities=impl.capabilities.to_dict())
        devices = set(impl.capabilities.devices)
        if devices & here:
            row["available"] = True
        else:
            need = ", ".join(sorted(devices))
            row["why"] = f"needs device {need}; here: {', '.join(sorted(here)) or 'none'}"
        rows.append(row)
    return rows
