"""ring-harness's import-time stub of `transformers` (NOT Hugging Face transformers).

ring-flash-attn 0.1.8's package `__init__` imports `.adapters.hf_adapter`, which at import time does
`import transformers`, `import transformers.modeling_flash_attention_utils` and `from
transformers.modeling_flash_attention_utils import is_flash_attn_greater_or_equal_2_10` (`from
transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS` sits in a bare try/except). This stub
provides exactly that, so `import ring_flash_attn` works where transformers is not installed.
`harness.kernels.flash_standin.install()` puts its folder (`standin/hf-stub`, a name no import can
reach) on sys.path only when no real transformers is importable. ring-flash-attn's HF adapter itself
(`substitute_hf_flash_attn`) does not work with it: it raises ValueError, as with an unsupported
version.
"""

__version__ = "0.0.0+ring-harness-stub"
__ring_harness_standin__ = True
