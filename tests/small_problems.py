"""Small decode problems for CPU tests: H=3 heads, L=32, R=16, pages of 4 tokens (fast eager, compiled
and in Triton's interpreter)."""

from mla_inductor.testing import make_decode_inputs


def small_inputs(**kw):
    """``make_decode_inputs`` with the small dimensions above unless ``kw`` names others."""
    return make_decode_inputs(**{"kv_lora_rank": 32, "rope_dim": 16, "page_size": 4, "num_heads": 3, **kw})
