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

from mla_inductor.contract import OP_ARG_NAMES, check_decode_values
from mla_inductor.lowering._compat import assert_on_device, keep_in_graph

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
        assert_decode_values_on_device(kv_cache, block_table, seq_lens, kv_scale, sparse_indices, q_scale, op)


@check_decode_values_op.register_fake
def _(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, q_scale, op):
    return None


CHECK_DECODE_VALUES = torch.ops.mla.check_decode_values.default
keep_in_graph(CHECK_DECODE_VALUES)  # it returns nothing: without this, dead-code elimination drops it


def assert_decode_values_on_device(kv_cache, block_table, seq_lens, kv_scale, sparse_indices, q_scale,
                                   op: str) -> None:
    """The checks of ``check_decode_values`` as device-side asserts (``torch._assert_async``): nothing
    waits for the device. The messages name the argument and the bound, as the eager ones do."""
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    lens = seq_lens.long()
    assert_on_device(((lens >= 0) & (lens <= capacity)).all(),
            f"mla.{op}: seq_lens must lie in [0, max_pages * page_size = {capacity}]")
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] * page_size < lens[:, None]
    pages = block_table.long()
    assert_on_device((~used | ((pages >= 0) & (pages < P))).all(),
            f"mla.{op}: block_table entries of used pages must lie in [0, num_pages={P})")
    if sparse_indices is not None:
        idx = sparse_indices.long()
        assert_on_device(((idx >= -1) & (idx < P * page_size)).all(),
                f"mla.{op}: sparse_indices must be -1 or a slot in [0, P * page_size = {P * page_size})")
    for name, scale in (("kv_scale", kv_scale), ("q_scale", q_scale)):
        if scale is not None:
            value = scale.reshape(())
            assert_on_device(torch.isfinite(value) & (value > 0), f"mla.{op}: {name} must be finite and positive")
