"""Everything that runs in a rank process or talks to one. docs/architecture.md is the map."""
