"""Value checks inside compiled graphs: the compiled call refuses what the eager call refuses.

The shape, dtype and device checks run at compile time (the fake impls). The checks that read data
(lengths within the block table, used pages and sparse slots in range, finite positive scales) need
the tensors' values, so the pass puts ``mla::check_decode_values`` before each call it rewrites when
``contract.wants_value_checks`` says so: always on CPU, on GPUs with ``MLA_INDUCTOR_DEBUG=1``. On CPU it
raises the eager call's ValueError, text and all; on a GPU it enqueues device-side asserts with the same
text (no host sync, so it also runs inside CUDA graphs): a failed one stops the process with CUDA's
"device-side assert triggered".
"""

from __future__ import annotations

from typing import Optional

import torch

from mla_inductor.contract import OP_ARG_NAMES, assert_decode_values_on_device, check_decode_values
from mla_inductor.lowering._compat import keep_in_graph

Tensor = torch.Tensor


# The decode op's arguments the checks read, in this order, followed by the op's name.
CHECKED_ARGS = tuple(OP_ARG_NAMES.index(name) for name in (
    "q_nope", "kv_cache", "block_table", "seq_lens", "kv_scale", "sparse_indices", "q_scale"))


@torch.library.custom_op("mla::check_decode_values", mutates_args=())
def check_decode_values_op(q_nope: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                           kv_scale: Tensor, sparse_indices: Optional[Tensor], q_scale: Optional[Tensor],
                           op: str) -> None:
    """``contract.check_decode_values`` of a compiled ``mla.<op>`` call: a ValueError on CPU, device-side
    asserts elsewhere."""
    if q_nope.device.type == "cpu":
        check_decode_values(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, op=op,
                            q_scale=q_scale)
    else:
        assert_decode_values_on_device(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, op=op,
                                       q_scale=q_scale)


@check_decode_values_op.register_fake
def _(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, q_scale, op):
    return None


CHECK_DECODE_VALUES = torch.ops.mla.check_decode_values.default
keep_in_graph(CHECK_DECODE_VALUES)  # it returns nothing: without this, dead-code elimination drops it
