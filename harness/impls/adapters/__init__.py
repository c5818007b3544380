"""Adapters: one module per implementation, each exposing factories that return an `Impl`.

Every module here imports only torch and the harness at import time; the third-party library is
imported inside the factory, so listing or unit-testing an adapter never needs the library.
"""
