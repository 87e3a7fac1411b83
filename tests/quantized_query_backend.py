"""A test backend whose kernel takes q in e4m3 (``Backend.quantized_query_op``), on any machine.

It serves only calls that opted in (``problem.fp8_query``), like FlashMLA-fp8, so the pass writes q's
assembly and quantization into the graph (``lowering/fp8_query.py``) and hands its op the e4m3 query.
The op computes the reference on the dequantized query and keeps a copy of each e4m3 query it was given
in ``QUERIES_SEEN``, so a test can compare the bits Inductor produced with a query quantized by hand.
"""

from typing import Optional

import torch

from mla_inductor.backends import Backend
from mla_inductor.backends._common import quantize_query_reference
from mla_inductor.reference import paged_decode_reference

QUERIES_SEEN: list[torch.Tensor] = []  # every e4m3 query the op received, in call order


def _attend_dequantized(q8, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                        latent, out_dtype):
    q = (q8.float() * q_descale).to(out_dtype)
    out, lse = paged_decode_reference(q[..., :latent].contiguous(), q[..., latent:].contiguous(), kv_cache,
                                      block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
    return out.to(out_dtype).contiguous(), lse.contiguous()


@torch.library.custom_op("mla_test::decode_quantized_query", mutates_args=(),
                         schema="(Tensor q, Tensor q_descale, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
                                "float softmax_scale, Tensor kv_scale, Tensor? sparse_indices, Tensor[] plan, "
                                "ScalarType out_dtype) -> (Tensor, Tensor)")
def decode_quantized_query(q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                           plan, out_dtype):
    assert q.dtype == torch.float8_e4m3fn and q_descale.shape == (1,), (q.dtype, q_descale.shape)
    QUERIES_SEEN.append(q.clone())
    return _attend_dequantized(q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                               sparse_indices, BACKEND.latent, out_dtype)


@decode_quantized_query.register_fake
def _(q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan, out_dtype):
    T, H, _ = q.shape
    return q.new_empty((T, H, BACKEND.latent), dtype=out_dtype), q.new_empty((T, H), dtype=torch.float32)


class QuantizedQueryBackend(Backend):
    name = "quantized_query_test"
    latent = 32  # the latent width L of the problems it is used on (the op's q is L + R wide)

    def supports(self, problem, capability):
        return None if problem.fp8_query else "computes with q in e4m3: opt in with a static q_scale"

    def quantized_query_op(self, problem):
        return torch.ops.mla_test.decode_quantized_query.default if problem.fp8_query else None

    def decode(self, *args):
        return paged_decode_reference(*args)

    def decode_with_q_scale(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                            sparse_indices, q_scale: Optional[torch.Tensor]):
        q8, descale = quantize_query_reference(torch.cat([q_nope, q_pe], -1), q_scale)
        return _attend_dequantized(q8, descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                   sparse_indices, q_nope.shape[-1], q_nope.dtype)


BACKEND = QuantizedQueryBackend()
