"""Adapters: one module per library, each declaring its built-in names once.

Every module has `VARIANTS`, `EXTRA` and a `make(name)` factory.
The registry lists the modules and builds its name table from their VARIANTS.
Third-party libraries are imported inside `make`, never at import time.
So listing or unit-testing an adapter never needs its library.
Details: docs/third-party.md, "How the adapters drive their libraries", the adapter package.
"""
