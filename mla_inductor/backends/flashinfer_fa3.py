"""FlashInfer's Hopper MLA decode (``BatchMLAPagedAttentionWrapper``, backend "fa3"): SM90 only.

bf16/fp16 and fp8_e4m3 (per-tensor scale) dense decode, Q >= 1 with the causal mask among the new
tokens, and top-k sparse decode by vLLM's SM90 recipe (page_size 1, the selected slots as the page
list). The plumbing is shared with fa2 in ``_flashinfer_common``.
"""

from __future__ import annotations

from mla_inductor.backends._common import sm
from mla_inductor.backends._flashinfer_common import FlashInferWrapperBackend


def _capability_reason(capability):
    # fa3 is compiled for sm_90a, whose wgmma/TMA instructions no later architecture runs.
    if capability != (9, 0):
        return f"needs SM90 (Hopper wgmma/TMA kernels), got {sm(capability)}"
    return None


BACKEND = FlashInferWrapperBackend("flashinfer_fa3", "fa3", _capability_reason)
