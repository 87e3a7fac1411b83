"""FP8 queries made by the compiler.

A backend whose kernel computes with q in e4m3 (``Backend.quantized_query_op``: FlashMLA's dense FP8
decode) would otherwise assemble and quantize q inside its opaque call: a copy of ``q_nope | q_pe``, an
amax pass and a cast, each a kernel Inductor cannot see. Here the pass writes them into the graph as
ordinary aten ops instead (``quantize_query_reference``: cat, abs, amax, div, clamp, convert), so Inductor
fuses the assembly and the cast into q's producers (the absorbed bmm's epilogue, the rope kernel) and
the opaque call receives the e4m3 query and its descale. With the call's static ``q_scale`` the amax pass
is gone too: the scale is a graph input.

Two pitfalls the peers' FP8 MLA paths met are avoided by construction or documented: one scale covers
the latent and the rope part (the kernel takes one ``descale_q``; vLLM #37054 and #42956 are about
scales that disagree between the two), and a static scale must be calibrated on real activations:
values past ±448 · q_scale saturate and the output is garbage (vLLM #38652).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mla_inductor.backends._common import quantize_query_reference


def quantized_query_call(op: Any, plan_op: Any, args: Sequence[Any], with_lse: bool, joined: Any = None):
    """What the pass traces in place of a call (``args``: the op's nine arguments, q_scale last) served by
    ``op``, a backend's ``quantized_query_op``: q's assembly and quantization as aten ops, the backend's
    plan (taking the e4m3 query's two slices: a plan reads only shapes), then the call. ``joined``: the
    tensor q_nope and q_pe are the halves of, when they are (quantized whole: no concatenation)."""
    q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, q_scale = args
    latent = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1) if joined is None else joined
    q8, q_descale = quantize_query_reference(q, q_scale)
    plan = []
    if plan_op is not None:
        plan = plan_op(q8.narrow(-1, 0, latent), q8.narrow(-1, latent, q8.shape[-1] - latent), kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                       sparse_indices)
    out, lse = op(q8, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan,
                  q_nope.dtype)
    return (out, lse) if with_lse else out
