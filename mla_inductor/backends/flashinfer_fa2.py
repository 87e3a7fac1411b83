"""FlashInfer's portable MLA decode (``BatchMLAPagedAttentionWrapper``, backend "fa2"): SM80 and newer.

bf16/fp16 dense and top-k sparse calls on any SM80+ GPU; fp8_e4m3 caches on SM90 only (FlashInfer's
FP8 MLA path is Hopper-only). The plumbing is shared with fa3 in ``_flashinfer_common``.
"""

from __future__ import annotations

from mla_inductor.backends._common import sm
from mla_inductor.backends._flashinfer_common import FlashInferWrapperBackend


def _capability_reason(capability):
    if capability < (8, 0):
        return f"needs SM80 or newer, got {sm(capability)}"
    return None


BACKEND = FlashInferWrapperBackend("flashinfer_fa2", "fa2", _capability_reason)
