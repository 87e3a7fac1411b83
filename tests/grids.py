"""The peers' published test grids as named decode cases, shared by tests/test_peer_grids.py,
tests/test_fuzz.py and benchmarks/sanitize_backends.py.

Dimensions taken from (their code is not used):

- FlashMLA ``tests/test_flash_mla_dense_decoding.py``: b 1/2/6/64, s_q 1/2/4, s_k 20/140/4096, varlen
  lengths ``max(normal(s_k, s_k/2), s_q)``, h_q 1/3/9/63/64/126/128, block 64, zero lengths; NaN in every
  unattended row, 2147480000 in unused block-table entries.
- FlashMLA ``tests/test_flash_mla_sparse_decoding.py`` / ``tests/lib.py``: (s_k, topk, block) (512, 64, 64),
  (1024, 576, 61), (2046, 2048, 64), s_q 1/3, all-invalid index rows, NaN in every slot no row lists.
- FlashInfer ``tests/attention/test_deepseek_mla.py``: kv_len 0/17/33/96/97/114/514/1024, qo_len 1..17 odd,
  heads 16/64, page 1/16 (``test_batch_mla_page_attention``); NaN in the last page's tail, page 16/32,
  kv_len 17/33/75/197, qo_len 3/7/17 (``test_batch_mla_oob_kv_nan``).
- vLLM ``tests/kernels/attention/test_flashmla.py`` (b 128, s_q 1/2, h_q 16..128, bf16/fp16/fp8, NaN past
  each length, unscaled ``randn`` queries), ``test_triton_decode_attention.py`` (B 3/5, L 1025/1027, page
  1/16, H_Q 32), ``test_mla_decode_cpu.py`` (page 16, NaN past each length).
- SGLang ``sgl-kernel/tests/test_flashmla.py``: FlashMLA's dense grid and topk 128/2048 sparse decode,
  queries ``randn`` clamped to ±1 at 128 heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from mla_inductor.testing import TOLERANCE, make_decode_inputs
from poison import HUGE_PAGE_ID, poisoned


@dataclass(frozen=True)
class Case:
    seq_lens: tuple
    heads: int = 16
    q_per_seq: int = 1
    page_size: int = 64
    fmt: str = "bf16"
    q_dtype: torch.dtype = torch.bfloat16
    topk: Optional[int] = None
    q_scale: float = 1.0  # multiplies make_decode_inputs' 0.5 * randn queries
    table_fill: Optional[int] = HUGE_PAGE_ID
    garbage: str = "nan"
    invalid_rows: int = 0  # sparse: this many rows listing nothing (all -1)
    repeated_slot: bool = False  # sparse: row 0 lists its first slot twice


@pytest.fixture(autouse=False)
def one_thread_on_cpu():
    """CPU cases here are small: one thread runs them faster than two threads waiting on each other
    (and much faster on a machine whose cores are busy with something else)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def compiled_decode(softmax_scale: float, dynamic: bool = True):
    """A compiled ``step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices) ->
    (out, lse)`` and its compile counter. The softmax scale is a constant of the step (a float argument
    would be traced as a tensor first under dynamic=True, which the op cannot take, and compiled twice);
    equal sizes stay separate symbols (no duck sizing), and more than 8 graphs fail instead of falling
    back to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import mla_inductor.lowering  # noqa: F401 - installs the pass

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices):
        return torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                                   kv_scale, sparse_indices)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True, specialize_float=True), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        yield torch.compile(step, fullgraph=True, dynamic=dynamic, backend=counter), counter
    torch._dynamo.reset()


def step_args(x) -> tuple:
    """A compiled_decode step's arguments from DecodeInputs (all but softmax_scale)."""
    return (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale, x.sparse_indices)


# Lengths drawn once like FlashMLA's varlen ones (max(normal(mean, mean / 2), s_q)), written out.
VARLEN_140 = (140, 71, 211, 2, 97, 176)
VARLEN_4096 = (4096, 2047, 5631)

CASES = {
    # FlashMLA dense grid: block 64, varlen, Q 1/2/4, non-power-of-two heads, zero lengths
    "flashmla_s20_h1": Case((20, 20), heads=1),
    "flashmla_s140_varlen_h3_q2": Case(VARLEN_140, heads=3, q_per_seq=2),
    "flashmla_s140_varlen_h63_q4": Case(VARLEN_140, heads=63, q_per_seq=4, fmt="fp16", q_dtype=torch.float16),
    "flashmla_s140_h126_fp8": Case((140, 140), heads=126, fmt="fp8_e4m3"),
    "flashmla_zero_lengths_h9_q2": Case((0, 140, 0, 20), heads=9, q_per_seq=2),
    "flashmla_s4096_varlen_h128": Case(VARLEN_4096, heads=128),
    "flashmla_s4096_h16_q2_fp8_ds_mla": Case((4096, 1), heads=16, q_per_seq=2, fmt="fp8_ds_mla"),
    # FlashMLA / SGLang sparse decode: topk 64 / 128 / 2048, padding, all-invalid rows, random garbage
    "flashmla_sparse_s512_topk64": Case((512, 300), heads=64, topk=64, fmt="fp8_ds_mla", garbage="bytes"),
    "flashmla_sparse_s2046_topk2048_q3": Case((2046, 700), heads=64, q_per_seq=3, topk=2048, fmt="fp8_ds_mla",
                                              invalid_rows=2),
    "sglang_sparse_topk128_bf16": Case((140, 20, 300), heads=128, topk=128, q_scale=2.0),
    "sparse_repeated_slot": Case((90, 30), heads=16, topk=64, repeated_slot=True),
    # FlashInfer: page 1 and 16, odd lengths and zero, odd Q up to 17, NaN in the last page's tail
    "flashinfer_page1_lens": Case((0, 17, 33, 96, 97, 114), heads=16, page_size=1),
    "flashinfer_page1_q5_h64": Case((514, 17), heads=64, q_per_seq=5, page_size=1),
    "flashinfer_oob_nan_page16_q7": Case((17, 33, 75, 197), heads=16, q_per_seq=7, page_size=16),
    "flashinfer_oob_nan_page16_q17": Case((197, 17), heads=16, q_per_seq=17, page_size=16),
    # vLLM: triton decode lengths 1025/1027 on pages of 1 and 16, FlashMLA-port queries unscaled, CPU MLA
    "vllm_triton_l1027_page1_h32": Case((1027, 1025, 3), heads=32, page_size=1, table_fill=-1),
    "vllm_triton_l1025_page16_h32": Case((1025, 1027), heads=32, page_size=16, fmt="fp16", q_dtype=torch.float16),
    "vllm_flashmla_randn_q_fp8_q2": Case((300, 64, 65), heads=32, q_per_seq=2, fmt="fp8_e4m3", q_scale=2.0),
    "vllm_cpu_page16_varlen": Case((256, 129, 2, 383), heads=16, page_size=16, fmt="fp32", q_dtype=torch.float32),
    # large-magnitude queries (logits of std ~10): the running max must keep the softmax finite
    "large_q_h16": Case((300, 65), heads=16, q_scale=20.0, garbage="inf"),
    # Q larger than a sequence: its first rows see nothing (out 0, lse -inf)
    "q4_longer_than_sequence": Case((2, 5, 0), heads=16, q_per_seq=4, page_size=2),
}

# Small enough for Triton's interpreter on CPU (L=512, R=64 are the kernels' sizes; few heads, short contexts).
INTERPRETER_CASES = {
    "page1_lens": Case((0, 17, 5), heads=3, page_size=1),
    "page16_q3_h5": Case((33, 2), heads=5, q_per_seq=3, page_size=16, table_fill=-1),
    "page64_fp8": Case((65, 1), heads=2, fmt="fp8_e4m3"),
    "page64_fp8_ds_mla_q2": Case((70, 0), heads=2, q_per_seq=2, fmt="fp8_ds_mla", garbage="bytes"),
    "sparse_topk24": Case((40, 9), heads=3, page_size=16, topk=24, invalid_rows=1, repeated_slot=True),
    "large_q": Case((50,), heads=2, page_size=16, q_scale=20.0, garbage="inf"),
}


def build(case: Case, device="cpu", seed: int = 0, kv_lora_rank: int = 512, rope_dim: int = 64):
    """The case's inputs with every unattended cache row garbage and unused block-table entries filled."""
    x = make_decode_inputs(list(case.seq_lens), num_heads=case.heads, q_per_seq=case.q_per_seq,
                           kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, page_size=case.page_size, fmt=case.fmt,
                           q_dtype=case.q_dtype, topk=case.topk, seed=seed)
    if case.q_scale != 1.0:
        x = dataclasses.replace(x, q_nope=(x.q_nope.float() * case.q_scale).to(case.q_dtype),
                                q_pe=(x.q_pe.float() * case.q_scale).to(case.q_dtype))
    if x.sparse_indices is not None and (case.invalid_rows or case.repeated_slot):
        sparse = x.sparse_indices.clone()
        if case.invalid_rows:
            sparse[-case.invalid_rows:] = -1
        if case.repeated_slot:
            sparse[0, 1] = sparse[0, 0]
        x = dataclasses.replace(x, sparse_indices=sparse)
    x = poisoned(x, garbage=case.garbage, table_fill=case.table_fill, seed=seed)
    return dataclasses.replace(x, **{k: v.to(device) for k, v in vars(x).items() if isinstance(v, torch.Tensor)})


def tolerances(case: Case, backend: str = "reference") -> tuple[float, float]:
    return tolerances_for(case.fmt, case.q_dtype, backend)


def tolerances_for(fmt: str, q_dtype: torch.dtype, backend: str = "reference") -> tuple[float, float]:
    """(out, lse) relative-error bounds against the float64 oracle. The output is rounded to q's dtype;
    the reference computes in fp32 (lse to 2e-5), the kernels' lse to 1e-3. A kernel computes in q's
    dtype, so a 16/32-bit cache of another dtype is rounded to q's (bf16: 8 bits) and a single logit
    carries that rounding into the lse: then the lse bound is q's dtype's too. fp8 caches are judged on
    the same dequantized bytes, so the bound covers the kernel's own rounding; backends that also
    quantize the query to e4m3 for an fp8 cache (FlashMLA's dense FP8 kernel, FlashInfer's TRT-LLM and
    XQA kernels) lose more: the bounds their own test files use. An fp8_ds_mla cache is dequantized to bf16
    inside the kernels: its lse bound is bf16's unit roundoff."""
    out_tol = 2e-5 if q_dtype == torch.float32 else TOLERANCE[q_dtype]
    if backend == "reference":
        return out_tol, 2e-5
    if fmt == "fp8_e4m3" and backend == "flashmla":
        return 3e-2, 1e-2
    if fmt == "fp8_e4m3" and backend in ("flashinfer_trtllm", "flashinfer_xqa"):
        return 5 * out_tol, 1e-3
    if fmt == "fp8_ds_mla":
        # The kernels dequantize each e4m3 tile times its fp32 scale to bf16 before the matrix product: every
        # key element is rounded to 8 bits, so a logit carries bf16's unit roundoff (2^-8) into the lse.
        # (Found by the GPU fuzz: FlashMLA's sparse kernel, large-magnitude q, lse error 1.09e-3.)
        return out_tol, 2 ** -8
    cache_rounded = fmt in STORED_16_32 and STORED_16_32[fmt] != q_dtype
    return out_tol, out_tol if cache_rounded else 1e-3


STORED_16_32 = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
