"""The post-grad rewrite of ``mla.merge_attn_states(_n)`` calls.

Off CUDA the op's eager implementation is the plain PyTorch reference; traced into aten ops here, it
becomes Inductor's own generated code (fused with its neighbours) instead of an opaque call back into
Python. On CUDA the call stays our Triton kernel (``mla_inductor.kernels.merge_attn_states``), whose
bandwidth benchmarks/bench_distributed.py measures.
"""

from __future__ import annotations

import functools

import torch

from mla_inductor.lowering._compat import Match, pattern_pass
from mla_inductor.merge import check_merge_args, check_merge_n_args, merge_reference

_MERGE_OPS = (torch.ops.mla.merge_attn_states.default, torch.ops.mla.merge_attn_states_n.default)


def _fake(value):
    return value.meta["val"] if isinstance(value, torch.fx.Node) else value


def _merge_two(out_a, lse_a, out_b, lse_b):
    return merge_reference([out_a, out_b], [lse_a, lse_b])


def _merge_stacked(outs, lses):
    return merge_reference(outs.unbind(0), lses.unbind(0))


def _lower_merge_call(match: Match, *args) -> None:
    fake = [_fake(a) for a in args]
    if fake[0].device.type == "cuda":
        return  # our kernel stays
    if match.nodes[0].target is torch.ops.mla.merge_attn_states.default:
        check_merge_args(*fake)
        match.replace_by_example(_merge_two, list(args))
    else:
        check_merge_n_args(*fake)
        match.replace_by_example(_merge_stacked, list(args))


@functools.cache
def _merge_patterns():
    return pattern_pass("mla_inductor_merge", _MERGE_OPS, _lower_merge_call)


def lower_merge_calls(graph: torch.fx.Graph) -> None:
    """Replace every off-CUDA merge call of ``graph`` by the reference's aten ops (in place)."""
    if any(n.op == "call_function" and n.target in _MERGE_OPS for n in graph.nodes):
        _merge_patterns().apply(graph)
