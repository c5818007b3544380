"""`python -m harness ...` is the same as `ring-harness ...`."""

from harness.commands.cli import entry

entry()
