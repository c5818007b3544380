"""Implementations the tests run on the ranks by module path (`tests.helpers.impls:NAME`): planted
bugs, fault-sensitive rings, and small helpers."""
