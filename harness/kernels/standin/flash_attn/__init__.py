"""ring-harness's CPU stand-in for flash-attn 2.8.3's Python API (not flash-attn; no CUDA anywhere).

Put on sys.path by `harness.kernels.flash_standin.install()` only where no real flash-attn is
importable, so that ring-flash-attn 0.1.8 and yunchang 0.6.4 run their ring logic for real on CPU
(gloo) ranks. It holds exactly what those two libraries import: `__version__`, `flash_attn_func`
and, in `flash_attn.flash_attn_interface`, the private forward/backward functions (padded and
varlen); see that module's docstring for the list, the signatures matched and what is refused.

`__version__` is 2.8.3, the version whose signatures are mirrored: yunchang compares it with '2.6.3'
as a string and takes the window_size_left/right call path; ring-flash-attn reads the functions'
argspecs. `__ring_harness_standin__ = True` tells it apart from a real flash-attn
(`flash_standin.kernel_label()`). `flash_attn_func` is imported on first use (PEP 562), so `import
flash_attn` alone does not import torch.
"""

__version__ = "2.8.3"
__ring_harness_standin__ = True

__all__ = ["flash_attn_func"]


def __getattr__(name: str):
    if name == "flash_attn_func":
        from .flash_attn_interface import flash_attn_func

        return flash_attn_func
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
