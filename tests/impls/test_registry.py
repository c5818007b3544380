"""The implementation registry: built-ins, entry points, module paths, refusals, one-line errors."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from harness.context import Capabilities
from harness.errors import HarnessError
from harness.impls import registry
from harness.impls.adapters._common import Variant
from harness.impls.registry import ImplError, MissingDependency

GPU_ONLY = [  # ring-flash-attn and yunchang run on CPU ranks through the flash-attn stand-in
    n for n in registry.builtin_names() if n.startswith(("te-cp", "torch-cp"))
]


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A throwaway importable module with an Impl, a factory and a plain run function."""
    name = "ring_harness_test_plugin"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from harness.context import Capabilities, Impl

            def run(q, k, v, ctx):
                return q

            def make():
                return Impl(name="made", run=run, capabilities=Capabilities(gqa=False), version="9")

            IMPL = Impl(name="plugin-impl", run=run, version="1.2")
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def test_builtins_listed():
    names = registry.builtin_names()
    for expected in (
        "reference",
        "ring-attention-pytorch",
        "torch-ring",
        "torch-ring-alltoall",
        "ring-flash-attn",
        "ring-flash-attn-zigzag",
        "ring-flash-attn-stripe",
        "ring-flash-attn-llama3",
        "torch-cp",
        "te-cp-p2p",
        "te-cp-a2a",
        "te-cp-all-gather",
        "te-cp-p2p-thd",
        "torch-flex-cp",
        "torch-flex-cp-compiled",
        "yunchang-ring",
        "yunchang-ulysses",
        "yunchang-usp",
    ):
        assert expected in names
    assert len(names) == len(set(names))


def test_importing_registry_imports_no_third_party_library():
    code = (
        "import sys, harness.impls.registry as r, harness.impls.adapters._common\n"
        # every adapter module
        "r.builtin_names(); [r.declared_capabilities(n) for n in r.builtin_names()]\n"
        "libs = ('ring_attention_pytorch', 'ring_flash_attn', 'flash_attn', 'yunchang', "
        "'transformer_engine',"
        " 'einops')\n"
        "print([m for m in libs if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_adapter_imports_the_registry():
    """The registry imports the adapters, never the reverse (no import circle)."""
    mods = ", ".join(f"harness.impls.adapters.{m}" for m in registry.ADAPTER_MODULES)
    code = f"import sys, {mods}\nprint('harness.impls.registry' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_builtin_is_declared_once_by_an_adapter_module():
    seen = []
    for short in registry.ADAPTER_MODULES:
        module = importlib.import_module(f"harness.impls.adapters.{short}")
        assert callable(module.make) and hasattr(module, "EXTRA"), short
        # one factory, no impl_* wrappers
        assert not [a for a in vars(module) if a.startswith("impl")], short
        for name, variant in module.VARIANTS.items():
            assert isinstance(variant, Variant) and isinstance(
                variant.capabilities, Capabilities
            ), name
            assert registry.BUILTINS[name] == f"{module.__name__}:make"
            assert registry.declared_capabilities(name) is variant.capabilities
            seen.append(name)
    assert seen == registry.builtin_names() == list(registry.BUILTINS)
    assert registry.declared_capabilities("no-such-impl") is None
    with pytest.raises(TypeError):
        registry.BUILTINS["x"] = "y"  # read-only


def test_make_refuses_a_name_its_module_does_not_declare():
    from harness.impls.adapters import torch_ring

    with pytest.raises(
        ImplError, match="no built-in variant 'torch-cp' here; declared: torch-ring, "
    ):
        torch_ring.make("torch-cp")


def test_one_error_hierarchy():
    from harness import errors

    assert (
        registry.ImplError is errors.ImplError
        and registry.MissingDependency is errors.MissingDependency
    )
    assert issubclass(errors.MissingDependency, errors.ImplError)
    assert issubclass(errors.ImplError, errors.HarnessError) and issubclass(
        errors.HarnessError, ValueError
    )
    for name in ("PoolError", "CommError", "ShapeError"):
        cls = getattr(errors, name)
        assert issubclass(cls, errors.RingHarnessError) and issubclass(cls, RuntimeError), name
        assert cls.__doc__, name
    assert issubclass(errors.HarnessError, errors.RingHarnessError)


def test_unknown_name_is_one_clear_line():
    with pytest.raises(ImplError) as e:
        registry.resolve("foo")
    msg = str(e.value)
    assert msg.startswith("unknown implementation 'foo'; built-in: reference, ")
    assert "torch-ring" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, HarnessError)


@pytest.mark.parametrize("bad", ["", "   ", "a:b:c", "pkg.mod:", ":attr", "1pkg:x"])
def test_malformed_names(bad):
    with pytest.raises(ImplError):
        registry.resolve(bad)


def test_module_attr_plain_run_declares_everything(plugin_module):
    """A bare run(q, k, v, ctx) declares nothing, so every case runs as supported: every mask of the
    mask language and idle ranks included (a wrapped Impl without capabilities keeps
    Capabilities()'s defaults)."""
    from ring_impl.masks import MASK_FEATURES

    spec = f"{plugin_module}:run"
    impl = registry.resolve(spec)
    assert impl.name == spec and impl.declared is False
    assert impl.capabilities == Capabilities(masks=frozenset(MASK_FEATURES), idle_ranks=True)
    assert impl.run(1, 2, 3, None) == 1


def test_module_attr_impl_and_factory(plugin_module):
    impl = registry.resolve(f"{plugin_module}:IMPL")
    assert (impl.name, impl.version) == ("plugin-impl", "1.2")
    made = registry.resolve(f"{plugin_module}:make")
    assert made.name == "made" and made.capabilities.gqa is False


def test_module_attr_errors(plugin_module):
    with pytest.raises(ImplError, match="has no attribute 'nope'"):
        registry.resolve(f"{plugin_module}:nope")
    with pytest.raises(ImplError, match="neither an Impl nor a callable"):
        registry.resolve(f"{plugin_module}:NOT_CALLABLE")
    with pytest.raises(ImplError, match="cannot import 'no_such_pkg_xyz.mod'.*No module named"):
        registry.resolve("no_such_pkg_xyz.mod:run")


def test_allow_import_false_refuses_module_path_without_importing(plugin_module):
    with pytest.raises(ImplError, match="is a module path; a case file may only name") as e:
        registry.resolve(f"{plugin_module}:IMPL", allow_import=False)
    assert "\n" not in str(e.value)
    assert plugin_module not in sys.modules


def test_allow_import_false_accepts_builtin_and_entry_point(plugin_module, monkeypatch):
    assert registry.resolve("torch-ring", allow_import=False).name == "torch-ring"
    ep = md.EntryPoint(
        name="plugin-ep", value=f"{plugin_module}:IMPL", group=registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(registry, "_entry_points", lambda: [ep])
    assert registry.resolve("plugin-ep", allow_import=False).name == "plugin-impl"
    assert "plugin-ep" in registry.entry_point_names()
    with pytest.raises(ImplError, match="installed: plugin-ep"):
        registry.resolve("not-there", allow_import=False)


def test_builtin_wins_over_entry_point_of_same_name(plugin_module, monkeypatch):
    ep = md.EntryPoint(
        name="torch-ring", value=f"{plugin_module}:IMPL", group=registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(registry, "_entry_points", lambda: [ep])
    assert registry.resolve("torch-ring").name == "torch-ring"
    assert "torch-ring" not in registry.entry_point_names()


def test_broken_entry_point_is_one_line(monkeypatch):
    ep = md.EntryPoint(
        name="broken", value="no_such_pkg_xyz:IMPL", group=registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(registry, "_entry_points", lambda: [ep])
    with pytest.raises(
        ImplError, match=r"^implementation 'broken' \(entry point no_such_pkg_xyz:IMPL\) failed"
    ):
        registry.resolve("broken")


def test_missing_optional_dependency_message(monkeypatch):
    fake = types.ModuleType("harness.impls.adapters._fake_missing")
    fake.EXTRA = "ring-flash-attn"
    fake.VARIANTS = {"fake": Variant(Capabilities())}

    def make(name):
        import no_such_library_xyz  # noqa: F401

    fake.make = make
    monkeypatch.setitem(sys.modules, "harness.impls.adapters._fake_missing", fake)
    monkeypatch.setattr(registry, "ADAPTER_MODULES", (*registry.ADAPTER_MODULES, "_fake_missing"))
    assert registry.builtin_names()[-1] == "fake"
    with pytest.raises(MissingDependency) as e:
        registry.resolve("fake")
    assert str(e.value) == (
        "implementation 'fake' needs the optional extra: pip install "
        "'ring-harness[ring-flash-attn]' "
        "(No module named 'no_such_library_xyz')"
    )


def test_real_missing_dependency_if_absent():
    import importlib.util

    # installed (its import may still need the
    if importlib.util.find_spec("ring_flash_attn") is not None:
        # transformers stub the ranks install)
        pytest.skip("ring-flash-attn is installed here")
    with pytest.raises(
        MissingDependency, match=r"pip install 'ring-harness\[ring-flash-attn\]' \(No module named"
    ):
        registry.resolve("ring-flash-attn-zigzag")


def test_describe_rows():
    rows = {r["name"]: r for r in registry.describe()}
    assert set(registry.builtin_names()) <= set(rows)
    torch_ring = rows["torch-ring"]
    assert torch_ring["available"] and torch_ring["version"].startswith("torch ")
    assert torch_ring["capabilities"]["devices"] == ["cpu"]
    for name in GPU_ONLY:
        row = rows[name]
        assert row["capabilities"] is not None and row["capabilities"]["devices"] == ["cuda"], name
        if not torch.cuda.is_available():
            assert not row["available"] and row["why"], name
            assert "\n" not in row["why"]
