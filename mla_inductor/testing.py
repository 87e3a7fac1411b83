"""Random, valid inputs for ``mla.paged_decode`` and the error measure kernels are judged by.

Used by the test suite, the benchmarks and anyone checking a new kernel against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mla_inductor.cache import cache_dtype, encode_tokens, fp8_scale_for, token_width

# Relative L2 error bounds vs the reference, by what limits precision. fp8 caches are judged against the
# reference on the same (dequantized) cache, so the bound covers only the kernel's own rounding.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1.6e-2}


@dataclass
class DecodeInputs:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    softmax_scale: float
    kv_scale: torch.Tensor
    sparse_indices: Optional[torch.Tensor] = None

    def args(self) -> tuple:
        return (self.q_nope, self.q_pe, self.kv_cache, self.block_table, self.seq_lens, self.softmax_scale,
                self.kv_scale, self.sparse_indices)


def make_decode_inputs(
    seq_lens: Sequence[int],
    *,
    num_heads: int = 16,
    q_per_seq: int = 1,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    page_size: int = 64,
    fmt: str = "bf16",
    q_dtype: torch.dtype = torch.bfloat16,
    topk: Optional[int] = None,
    spare_pages: int = 3,
    max_pages: Optional[int] = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> DecodeInputs:
    """A paged cache with scattered pages (some unused), garbage (-1) in unused block-table entries,
    fresh random values everywhere, and for ``topk`` random slots of each row's visible prefix,
    padded with -1 where the prefix is shorter than ``topk``. ``max_pages`` fixes the block table's width
    (default: the longest sequence's page count)."""
    g = torch.Generator().manual_seed(seed)
    B, Q = len(seq_lens), q_per_seq
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pages_per_seq = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max(1, max(pages_per_seq)) if max_pages is None else max_pages
    num_pages = sum(pages_per_seq) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    block_table = torch.full((B, max_pages), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = perm[used:used + n].int()
        used += n
    values = torch.randn(num_pages, page_size, kv_lora_rank + rope_dim, generator=g)
    kv_scale = fp8_scale_for(values) if fmt == "fp8_e4m3" and values.numel() else torch.ones(1)
    kv_cache = encode_tokens(values, fmt, kv_scale)
    assert kv_cache.dtype == cache_dtype(fmt) and kv_cache.shape[-1] == token_width(fmt, kv_lora_rank, rope_dim)
    T = B * Q
    q_nope = (torch.randn(T, num_heads, kv_lora_rank, generator=g) * 0.5).to(q_dtype)
    q_pe = (torch.randn(T, num_heads, rope_dim, generator=g) * 0.5).to(q_dtype)
    sparse = None
    if topk is not None:
        sparse = torch.full((T, topk), -1, dtype=torch.int32)
        for b in range(B):
            for j in range(Q):
                visible = max(0, int(lens[b]) - Q + j + 1)
                pos = torch.randperm(visible, generator=g)[:topk]
                slots = block_table[b, pos // page_size].long() * page_size + pos % page_size
                sparse[b * Q + j, : len(pos)] = slots.int()
    inputs = DecodeInputs(q_nope, q_pe, kv_cache, block_table, lens, (kv_lora_rank + rope_dim) ** -0.5,
                          kv_scale.float(), sparse)
    for name, value in vars(inputs).items():
        if isinstance(value, torch.Tensor):
            setattr(inputs, name, value.to(device))
    return inputs


# Calls with nothing (or little) to attend, the inputs no kernel takes as they are: every backend must give
# the contract's result (rows that see nothing: out 0, lse -inf) without reading outside what it was given.
# name -> make_decode_inputs arguments; ``all_padding``: every sparse slot -1.
EDGE_CASES = {
    "all_lengths_0": dict(seq_lens=[0, 0, 0]),  # pages exist: kernels run on lengths clamped to 1
    "all_lengths_0_no_pages": dict(seq_lens=[0, 0], spare_pages=0),  # a cache of no pages (P = 0)
    "some_lengths_0": dict(seq_lens=[0, 70, 0, 1]),
    "table_width_0": dict(seq_lens=[0, 0], max_pages=0),  # block_table [B, 0]
    "batch_0": dict(seq_lens=[], max_pages=1),  # B = 0, T = 0
    "q4_short_lengths": dict(seq_lens=[1, 3, 0, 4, 6], q_per_seq=4),  # rows before position 0 see nothing
    "sparse_all_padding": dict(seq_lens=[40, 0], topk=64, all_padding=True),
    "sparse_some_rows_empty": dict(seq_lens=[40, 0, 1], topk=64),
    "sparse_topk_0": dict(seq_lens=[40, 3], topk=0),
}
DENSE_EDGE_FORMATS = ("bf16", "fp8_e4m3", "fp8_ds_mla")
SPARSE_EDGE_FORMATS = ("bf16", "fp8_ds_mla")


def edge_case_grid() -> list[tuple[str, str]]:
    """(case, cache format) pairs: each dense case in every dense format, each sparse one in every sparse
    format (FlashMLA's sparse kernels take fp8_ds_mla, FlashInfer's bf16)."""
    return [(name, fmt) for name, spec in EDGE_CASES.items()
            for fmt in (SPARSE_EDGE_FORMATS if "topk" in spec else DENSE_EDGE_FORMATS)]


def edge_case_inputs(name: str, fmt: str = "bf16", *, num_heads: int = 64, kv_lora_rank: int = 512,
                     rope_dim: int = 64, device: torch.device | str = "cpu", seed: int = 0) -> DecodeInputs:
    """The inputs of ``EDGE_CASES[name]`` with a ``fmt`` cache (q in bf16)."""
    spec = dict(EDGE_CASES[name])
    all_padding = spec.pop("all_padding", False)
    x = make_decode_inputs(**spec, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, fmt=fmt,
                           seed=seed)
    if all_padding:
        x.sparse_indices.fill_(-1)
    for field, value in vars(x).items():
        if isinstance(value, torch.Tensor):
            setattr(x, field, value.to(device))
    return x


def backend_call_paths(backend, args: tuple) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Run one call through every path a backend offers, as ``(what, out, lse)``: ``decode`` (what eager
    dispatch calls), then what a compiled graph calls (the Inductor pass's replacement): the plan op once and
    the decode op with that plan (and the one of graphs compiled without CUDA graphs, where it differs), the
    out-only op (lse: the decode op's) and the decode-and-plan op where the backend has them. A backend without
    ops is traced by the pass from ``decode``: nothing more to call."""
    from mla_inductor.selection import CallContext

    paths = [("decode", *backend.decode(*args))]
    op, plan_op = backend.compiled_op(), backend.plan_op()
    if op is None:
        return paths
    plan = plan_op(*args) if plan_op is not None else []
    paths.append(("compiled_op", *op(*args, plan)))
    uncaptured = backend.compiled_op_for(CallContext(calls_sharing_plan=1, captured=False))
    if uncaptured is not op:  # the op of graphs compiled without CUDA graphs, where it differs
        paths.append(("compiled_op (no CUDA graphs)", *uncaptured(*args, plan)))
    if backend.out_only_op() is not None:
        paths.append(("out_only_op", backend.out_only_op()(*args, plan), paths[-1][2]))
    uncaptured_out_only = backend.out_only_op_for(CallContext(calls_sharing_plan=1, captured=False))
    if uncaptured_out_only is not None and uncaptured_out_only is not backend.out_only_op():
        paths.append(("out_only_op (no CUDA graphs)", uncaptured_out_only(*args, plan), paths[-1][2]))
    if backend.decode_and_plan_op() is not None:
        out, lse, *_ = backend.decode_and_plan_op()(*args)
        paths.append(("decode_and_plan_op", out, lse))
    return paths


def lse_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``relative_error`` for log-sum-exps, absolute where they are small: ‖actual − expected‖ /
    max(‖expected‖, √n) over the n finite entries. An lse enters every use (merging partial results) through
    ``exp(lse_a - lse_b)``, so what matters is its absolute error; a relative bound would ask a kernel that
    rounds q to its dtype for 1e-3 of a logit that happens to be 4e-4. Non-finite entries as in
    ``relative_error``."""
    if relative_error(actual, expected) == float("inf"):
        return float("inf")
    finite = torch.isfinite(expected)
    a, e = actual.double()[finite], expected.double()[finite]
    return float((a - e).norm()) / max(float(e.norm()), float(finite.sum()) ** 0.5, 1e-30)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 over the finite entries of ``expected``; the other
    entries (lse = -inf) must match exactly. Any mismatch or non-finite value in ``actual`` where
    ``expected`` is finite gives inf, so a kernel that leaves poisoned outputs unwritten never passes."""
    if actual.shape != expected.shape:
        return float("inf")
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    if not bool(torch.isfinite(a[finite]).all()) or not bool((a[~finite] == e[~finite]).all()):
        return float("inf")
    diff = (a[finite] - e[finite]).norm()
    return float(diff / e[finite].norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------
# Random-weight Hugging Face models and filled caches (tests, examples, benchmarks; no hub access)


def random_mla_model(
    model_type: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **config_overrides,
):
    """A randomly initialised ``*ForCausalLM`` of transformers' ``model_type`` (e.g. "deepseek_v3") from its
    config class's defaults plus ``config_overrides``, in eval mode. The defaults are the real model's
    sizes: override them for anything small."""
    from mla_inductor._transformers import require_transformers

    transformers = require_transformers()
    from mla_inductor._hf import SUPPORTED_MODEL_TYPES

    config = transformers.AutoConfig.for_model(model_type, **config_overrides)
    config._attn_implementation = attn_implementation
    support = SUPPORTED_MODEL_TYPES.get(model_type)
    # Not every supported type is in AutoModelForCausalLM's table (mistral4): the table names the class.
    model_class = getattr(transformers, support.causal_lm) if support else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config) if support else model_class.from_config(config)
    return model.to(dtype).eval()


def random_deepseek_model(version: str = "v3", **kwargs):
    """A random ``DeepseekV{2,3}ForCausalLM`` (``version`` "v2" or "v3"); see ``random_mla_model``."""
    model_types = {"v2": "deepseek_v2", "v3": "deepseek_v3"}
    if version not in model_types:
        raise ValueError(f"version must be 'v2' or 'v3', got {version!r}")
    return random_mla_model(model_types[version], **kwargs)


def fill_paged_mla_cache(cache, num_tokens: int, seed: int = 0) -> None:
    """Give every sequence of a ``mla_inductor.hf.PagedMLACache`` ``num_tokens`` tokens of random latents
    (unit RMS, like the normalised latent) and rope keys in every layer, without running the model: a
    long context for benchmarks in seconds."""
    device = cache.seq_lens.device
    B = cache.batch_size
    g = torch.Generator(device=device).manual_seed(seed)
    positions = torch.arange(num_tokens, device=device).expand(B, num_tokens)
    slots = cache.slot_mapping(positions)
    for kv in cache.kv_caches:
        for part in slots.split(1 << 16):
            n = part.shape[0]
            kv_c = torch.randn(n, cache.kv_lora_rank, device=device, generator=g, dtype=torch.bfloat16)
            k_pe = torch.randn(n, cache.rope_dim, device=device, generator=g, dtype=torch.bfloat16)
            torch.ops.mla.cache_append(kv, kv_c, k_pe, part, cache.kv_scale)
    cache.set_length(num_tokens)
