"""The reference backend: plain PyTorch, any device; the compiled path traces it into Inductor code."""

from __future__ import annotations

from mla_inductor.backends import Backend
from mla_inductor.reference import paged_decode_reference


class ReferenceBackend(Backend):
    name = "reference"

    def supports(self, problem, capability):
        return None

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        return paged_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                      sparse_indices)


BACKEND = ReferenceBackend()
