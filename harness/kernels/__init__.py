"""Rank-side compute kernels.

Modules here import torch (and the standard library) only, never anything else from `harness`: they
are installed into rank processes, which may run with nothing of the harness importable but this
folder.

- `flash_standin`: puts the CPU stand-in for flash-attn's Python API (`standin/flash_attn`) on
  sys.path when no real flash-attn is importable, so that ring-flash-attn and yunchang run for real
  on CPU ranks.
"""
