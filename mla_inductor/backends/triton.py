"""Our Triton MLA decode kernel (``kernels/decode.py``) as a backend: the FP8-KV and portable path.

Runs on any CUDA GPU Triton supports (fp8 caches from SM89, where e4m3 has hardware conversions) and,
under ``TRITON_INTERPRET=1``, on CPU tensors (that is how CI tests the kernels). It also writes caches on
CUDA (``kernels/cache_append.py``: a program per token, no host sync, so a decode step stays capturable).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

from mla_inductor._memo import Memo
from mla_inductor.backends import Backend
from mla_inductor.backends._common import decode_op, sm
from mla_inductor.contract import call_signature

SUPPORTED_L = (256, 512)
SUPPORTED_R = (32, 64)
_FP8_FORMATS = ("fp8_e4m3", "fp8_ds_mla")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_missing() -> Optional[str]:
    """Why triton cannot be used, asked once per process (``find_spec`` searches the import path on every
    call: tens of µs, where the cache writer asked it once per layer and step)."""
    return "triton is not installed" if importlib.util.find_spec("triton") is None else None


# The prepared launches (kernels/decode.py ``DecodeLaunch``) per call signature: checks, launch configuration and
# kernel arguments are worked out once, and the kernels relaunched without Triton's JIT front door.
_LAUNCHES: Memo = Memo()


def prepared_launch(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
    """The ``DecodeLaunch`` of this call's signature (``contract.call_signature``), made on its first call."""
    key = call_signature(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
    launch = _LAUNCHES.get(key)
    if launch is None:
        from mla_inductor.kernels.decode import DecodeLaunch

        launch = _LAUNCHES.put(key, DecodeLaunch(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                                 kv_scale, sparse_indices))
    return launch


def _run(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    """``mla.paged_decode_with_lse`` on our Triton kernel (``plan`` is unused: the split count is chosen
    from static shapes, so nothing is planned per step)."""
    launch = prepared_launch(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
    return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices)


def _run_keeping_workspace(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                           plan):
    """``_run`` with the split-KV workspace kept per stream, as eager calls keep it: for graphs compiled without
    CUDA graphs (CUDA-graph trees warm a graph up with every allocation in the graph's pool, where a kept
    workspace would be memory no output accounts for; a capture the user makes is seen and gets a fresh one)."""
    launch = prepared_launch(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
    return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, keep_workspace=True)


def _run_out_keeping_workspace(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                               plan):
    """``_run_keeping_workspace`` for a call whose lse nobody reads (``mla.paged_decode``): out only, the lse the
    kernel must write going to the launch's kept scratch instead of a fresh allocation."""
    launch = prepared_launch(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
    return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, keep_workspace=True,
                  need_lse=False)[0]


class _DecodeSite:
    """The decode op at one site of compiled code (``decode_op``'s ``call_site``): shapes, dtypes, devices and
    which optional tensors are given are fixed there, so a call finds its prepared launch by its tensors'
    strides alone (a few attribute reads, where ``call_signature`` reads every property of every argument).
    ``out_only``: the site returns out alone (the lse going to the kept scratch)."""

    __slots__ = ("keep_workspace", "launches", "out_only")

    def __init__(self, keep_workspace: bool, out_only: bool = False):
        self.keep_workspace = keep_workspace
        self.out_only = out_only
        self.launches: dict = {}

    def __call__(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None,
                 plan=()):
        strides = (q_nope.stride(), q_pe.stride(), kv_cache.stride(), block_table.stride(), seq_lens.stride(),
                   None if kv_scale is None else kv_scale.stride(),
                   None if sparse_indices is None else sparse_indices.stride())
        launch = self.launches.get(strides)
        if launch is None:
            launch = self.launches[strides] = prepared_launch(q_nope, q_pe, kv_cache, block_table, seq_lens,
                                                              softmax_scale, kv_scale, sparse_indices)
        if self.out_only:
            return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices,
                          keep_workspace=True, need_lse=False)[0]
        return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices,
                      keep_workspace=self.keep_workspace)


DECODE_OP = decode_op("mla_triton::decode", _run, call_site=lambda facts: _DecodeSite(False))
DECODE_KEEPING_WORKSPACE_OP = decode_op("mla_triton::decode_keeping_workspace", _run_keeping_workspace,
                                        call_site=lambda facts: _DecodeSite(True))
DECODE_OUT_KEEPING_WORKSPACE_OP = decode_op("mla_triton::decode_out_keeping_workspace", _run_out_keeping_workspace,
                                            returns="out", call_site=lambda facts: _DecodeSite(True, out_only=True))


class TritonBackend(Backend):
    name = "triton"
    libraries = ("triton",)
    environment = ("TRITON_INTERPRET",)  # decides whether CPU tensors are supported

    def unavailable_reason(self) -> Optional[str]:
        return _triton_missing()

    def supports(self, problem, capability) -> Optional[str]:
        if problem.device_type == "cpu":
            if not _interpreting():
                return "CPU tensors run Triton only under TRITON_INTERPRET=1"
        elif problem.device_type != "cuda" or capability is None:
            return f"needs a CUDA GPU, got {problem.device_type}"
        elif capability < (8, 0):
            return f"needs SM80 or newer, got {sm(capability)}"
        elif problem.cache_format in _FP8_FORMATS and capability < (8, 9):
            return f"{problem.cache_format} caches need SM89 or newer (e4m3 conversions), got {sm(capability)}"
        if problem.kv_lora_rank not in SUPPORTED_L:
            return f"kv_lora_rank must be one of {SUPPORTED_L}, got {problem.kv_lora_rank}"
        if problem.rope_dim not in SUPPORTED_R:
            return f"rope dim must be one of {SUPPORTED_R}, got {problem.rope_dim}"
        return None

    def compiled_op(self):
        return DECODE_OP

    def compiled_op_for(self, context):
        # A fresh split-KV workspace costs more host time than the merge launch it feeds
        # (docs/results.md#program-shapes): kept where the graph is not captured by CUDA-graph trees.
        if context is not None and not context.captured:
            return DECODE_KEEPING_WORKSPACE_OP
        return DECODE_OP

    def out_only_op_for(self, context):
        # mla.paged_decode reads no lse: outside CUDA-graph trees the kernel writes it into a kept scratch.
        if context is not None and not context.captured:
            return DECODE_OUT_KEEPING_WORKSPACE_OP
        return None

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        return DECODE_OP(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, [])

    def eager_decode(self, problem, args, with_lse, captured=False):
        # The signature's prepared launch (shared with the compiled op); each call only allocates and launches
        # (ops.py has checked the signature and that the call attends something).
        launch = prepared_launch(*args[:8])

        def decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, q_scale):
            out, lse = launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices,
                              keep_workspace=True, need_lse=with_lse)
            return (out, lse) if with_lse else out

        return decode

    def append_supports(self, device_type, capability):
        return None if device_type == "cuda" else f"writes caches on CUDA only, got {device_type}"

    def append(self, kv_cache, kv_c, k_pe, slot_mapping, kv_scale):
        from mla_inductor.kernels.cache_append import triton_cache_append

        triton_cache_append(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)


BACKEND = TritonBackend()
