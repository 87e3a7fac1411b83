"""The reference backend: plain PyTorch, any device; the compiled path traces it into Inductor code.

It also writes caches (``mla.cache_append``) wherever no kernel does: CPU, and any device without Triton.
"""

from __future__ import annotations

from mla_inductor.backends import Backend
from mla_inductor.reference import cache_append_reference, paged_decode_reference


class ReferenceBackend(Backend):
    name = "reference"
    last_resort = True

    def supports(self, problem, capability):
        return None

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        return paged_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                      sparse_indices)

    def append_supports(self, device_type, capability):
        return None

    def append(self, kv_cache, kv_c, k_pe, slot_mapping, kv_scale):
        cache_append_reference(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)


BACKEND = ReferenceBackend()
