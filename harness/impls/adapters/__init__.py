"""Adapters: one module per library, each declaring its built-in names once and one factory.

Every adapter module has:
- `VARIANTS: dict[str, Variant]`: built-in name -> `Variant(capabilities, option)` (see `_common`),
  in listing order;
- `EXTRA`: the optional extra that installs its library (None: torch or the project itself);
- `make(name) -> Impl`: the implementation for one of its names.

The registry lists the modules (`registry.ADAPTER_MODULES`) and builds the name table from their
VARIANTS; no adapter imports the registry. Every module here imports only torch and the harness at
import time; the third-party library is imported inside `make`, so listing or unit-testing an
adapter never needs the library.
"""
