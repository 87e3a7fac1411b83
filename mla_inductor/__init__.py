"""mla-inductor: DeepSeek-style MLA paged decode as a PyTorch op that torch.compile makes fast.

``import mla_inductor`` registers ``torch.ops.mla.paged_decode``, ``paged_decode_with_lse`` and
``cache_append`` (CPU-only machines included; no CUDA initialisation, no optional library imported).
``import mla_inductor.lowering`` also installs the Inductor pass that rewrites the calls into the best
kernel for the device when a model is compiled.
"""

from mla_inductor.cache import PagedLatentCache, cache_format, fp8_scale_for, pack_fp8_ds_mla, unpack_fp8_ds_mla
from mla_inductor.contract import DecodeProblem, cache_append, paged_decode, paged_decode_with_lse
from mla_inductor.reference import paged_decode_reference
from mla_inductor.selection import backend_for_call, prefer_backends, select_backend

__version__ = "0.1.0"

__all__ = [
    "DecodeProblem",
    "backend_for_call",
    "PagedLatentCache",
    "cache_append",
    "cache_format",
    "fp8_scale_for",
    "pack_fp8_ds_mla",
    "paged_decode",
    "paged_decode_reference",
    "paged_decode_with_lse",
    "prefer_backends",
    "select_backend",
    "unpack_fp8_ds_mla",
]
