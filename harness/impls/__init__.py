"""Implementations under test: resolving a name (`registry`), the capability rule and matrix
(`capabilities`), localisation probes (`probe`), and one adapter module per library
(`adapters/`)."""
