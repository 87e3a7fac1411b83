"""The peer MLA decode kernels the benchmarks time ours against, found by import, and the cases they share.

Peers (each needs its library; a missing one raises ``PeerMissing`` with what to install, and the
benchmark reports it and goes on):

- FlashMLA, vLLM's build: ``vllm.third_party.flashmla.flash_mla_interface`` (dense bf16, sparse
  fp8_ds_mla) and ``vllm._flashmla_extension_C`` (dense fp8): ``flashmla``, ``flashmla_fp8``,
  ``flashmla_sparse_fp8``; the sparse kernel on every position of a dense call on the fp8_ds_mla cache:
  ``flashmla_sparse_fp8_all``.
- FlashMLA, the ``flash_mla`` package (DeepSeek's, or the sgl-flash-mla wheel with its SM90 "legacy"
  kernels, installed with ``pip install --no-deps sgl-flash-mla``): ``sgl_flashmla``, ``sgl_flashmla_fp8``,
  ``sgl_flashmla_sparse_fp8``, ``sgl_flashmla_sparse_fp8_all``.
- FlashInfer (``flashinfer``): ``BatchMLAPagedAttentionWrapper`` fa2 / fa3, bf16 and fp8 caches, and
  vLLM's SM90 sparse recipe (page size 1): ``flashinfer_fa2(_fp8)``, ``flashinfer_fa3(_fp8)``,
  ``flashinfer_fa3_sparse``.
- vLLM's Triton MLA decode (``vllm.v1.attention.ops.triton_decode_attention``): ``vllm_triton_bf16``,
  ``vllm_triton_fp8``.

Cases are DeepSeek-V3 shaped (kv_lora_rank 512, rope 64, page 64) with scattered pages, bf16 q and
cache; ``reference`` / ``sparse_reference`` compute the fp32 result each kernel is checked against.
Every peer maker takes a case and returns a zero-argument function running one call, its plan / schedule /
quantized query made once by the maker, never by the call; a dense peer reads its query from the case
entries ``QUERY_ENTRIES`` names (made from ``c["q"]`` when absent).

A peer's direct call back to back (``direct_step``) is made here once for every benchmark that compares
with "the fastest peer's direct call" (bench_modes, bench_host_overhead): the peers of the cache format
(``DIRECT_PEERS``), ``calls`` calls per step, each by the peer's own Python call on its own query and cache
(``back_to_back_inputs``: the layers of one model step), plan made once when the step is made. Each
benchmark only chooses its clock (and says which in its docstring).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

D_CKV, D_PE = 512, 64
D_QK = D_CKV + D_PE
PAGE = 64
FP8_MAX = 448.0
CACHE_COPIES_BYTES = 16 << 30  # at most this much memory in per-call cache copies

# (B, H, S) cases, ("var", B, H, S) for lengths drawn from [S/8, S]; sparse cases are (B, H, S, top-k).
# H: DeepSeek-V3's 128 heads on one GPU, and per GPU at tensor parallel 2 (64), 4 (32) and 8 (16).
FULL = [(1, 128, 4096), (16, 128, 4096), (64, 128, 4096), (128, 128, 4096), (128, 128, 1024),
        (32, 128, 16384), (1, 16, 4096), (32, 16, 4096), (128, 16, 4096), (128, 32, 4096), (64, 64, 8192),
        ("var", 64, 128, 8192)]
QUICK = [(64, 128, 4096), (32, 16, 4096)]
SPARSE = [(32, 128, 16384, 2048), (128, 128, 16384, 2048), (64, 64, 32768, 2048)]


class PeerMissing(RuntimeError):
    """A peer's library is not installed (the message says which and how to get it)."""


def require(module: str, install: str):
    """Import ``module`` or raise PeerMissing naming the package that provides it."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ModuleNotFoundError(module)
        return importlib.import_module(module)
    except ImportError as e:
        raise PeerMissing(f"{module} is not installed ({install}): {type(e).__name__}: {e}") from None


def _flashinfer():
    return require("flashinfer", "pip install flashinfer-python")


def _vllm_flashmla():
    return require("vllm.third_party.flashmla.flash_mla_interface", "vLLM's FlashMLA build: pip install vllm")


def _vllm_flashmla_fp8_ops():
    require("vllm._flashmla_extension_C", "vLLM's dense FP8 FlashMLA: pip install vllm")
    return torch.ops._flashmla_extension_C


def _flash_mla():
    return require("flash_mla", "DeepSeek's FlashMLA package, or pip install sgl-flash-mla")


# ----------------------------------------------------------------------------- cases and references

def make_case(B: int, H: int, S: int, page: int = PAGE, varlen: bool = False, seed: int = 0) -> dict:
    """q [B, H, 576] and a bf16 cache [P, page, 576] with scattered pages (some unused), on the GPU."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.randint(max(1, S // 8), S + 1, (B,), generator=g) if varlen else torch.full((B,), S)
    pages_per = (lens + page - 1) // page
    total = int(pages_per.sum())
    perm = torch.randperm(total + 7, generator=g)[:total]
    block_table = torch.zeros(B, int(pages_per.max()), dtype=torch.int32)
    used = 0
    for b in range(B):
        n = int(pages_per[b])
        block_table[b, :n] = perm[used:used + n].int()
        used += n
    cache = torch.randn(total + 7, page, D_QK, generator=g).to(torch.bfloat16)
    q = (torch.randn(B, H, D_QK, generator=g) * 0.5).to(torch.bfloat16)
    return dict(B=B, H=H, S=S, page=page, lens=lens.int().cuda(), block_table=block_table.cuda(),
                cache=cache.cuda(), q=q.cuda(), scale=1.0 / math.sqrt(192))


def reference(c: dict, cache=None) -> torch.Tensor:
    """fp32 attention output [B, H, 512] of a dense case (each sequence's first ``lens[b]`` positions)."""
    cache = c["cache"] if cache is None else cache
    outs = []
    for b in range(c["B"]):
        n = int(c["lens"][b])
        pages = c["block_table"][b, : (n + c["page"] - 1) // c["page"]].long()
        kv = cache[pages].reshape(-1, D_QK)[:n].float()
        s = (c["q"][b].float() @ kv.T) * c["scale"]
        outs.append(torch.softmax(s, -1) @ kv[:, :D_CKV])
    return torch.stack(outs)


def fp8_cache(c: dict):
    """(the cache in e4m3 with one per-tensor scale, the scale); also keeps the reference on its
    dequantized values in ``c["ref_fp8"]``."""
    if "cache_fp8" not in c:
        k_scale = (c["cache"].abs().amax().float() / FP8_MAX).reshape(())
        c["k_scale"] = k_scale
        c["cache_fp8"] = (c["cache"].float() / k_scale).to(torch.float8_e4m3fn)
        c["ref_fp8"] = reference(c, (c["cache_fp8"].float() * k_scale).to(torch.bfloat16))
    return c["cache_fp8"], c["k_scale"]


def query_scale(c: dict) -> torch.Tensor:
    """The per-tensor e4m3 scale of the case's query, [1] fp32: what the fp8 peers quantize q with (once,
    outside the timing), and the static q_scale the benchmarks give our op for a like-for-like row."""
    return (c["q"].abs().amax().float() / FP8_MAX).reshape(1)


def _fp8_query(c: dict, cache, k_scale):
    """q in e4m3 (per-tensor scale) for kernels that take it so: ``c["q_fp8"]`` with ``c["q_scale"]`` where the
    caller quantizes q itself (bench_pass --q-producer, in the timed step), else quantized here, once; the
    reference on the dequantized q and cache goes to ``c["ref_fp8q"]``."""
    if "q_fp8" in c:
        q, q_scale = c["q_fp8"], c["q_scale"]
    else:
        q_scale = query_scale(c)
        q = (c["q"].float() / q_scale).to(torch.float8_e4m3fn)
    qd = (q.float() * q_scale).to(torch.bfloat16)
    c["ref_fp8q"] = reference(dict(c, q=qd), (cache.float() * k_scale).to(torch.bfloat16))
    return q.unsqueeze(1), q_scale


def ds_mla_cache(cache: torch.Tensor):
    """[P, page, 576] bf16 -> ([P, page, 656] uint8 fp8_ds_mla rows, their dequantized bf16 copy)."""
    P, page, _ = cache.shape
    lat = cache[..., :D_CKV].float().reshape(P, page, 4, 128)
    scale = (lat.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-8)
    q8 = (lat / scale).to(torch.float8_e4m3fn)
    out = torch.empty(P, page, 656, dtype=torch.uint8, device=cache.device)
    out[..., :512] = q8.reshape(P, page, 512).view(torch.uint8)
    out[..., 512:528] = scale.reshape(P, page, 4).contiguous().view(torch.uint8)
    out[..., 528:] = cache[..., D_CKV:].contiguous().view(torch.uint8)
    deq = torch.cat([(q8.float() * scale).reshape(P, page, 512), cache[..., D_CKV:].float()], -1)
    return out, deq.to(torch.bfloat16)


@dataclass
class FormatCase:
    """A dense case in one cache format: ``make_case``'s data ``c`` and what our op takes for it."""

    B: int
    H: int
    fmt: str  # "bf16" or "fp8_e4m3" (one per-tensor scale)
    c: dict
    kv_cache: torch.Tensor  # the cache in ``fmt``, also ``c[cache_key]``
    kv_scale: torch.Tensor  # [1] fp32 (1 for bf16)
    cache_key: str  # the entry of ``c`` the format's peers read their cache from
    reference: torch.Tensor  # fp32 [B, H, 512] on the cache's values as stored (fp8: dequantized), bf16 q
    host_lens: torch.Tensor  # a host copy of ``c["lens"]``
    varlen: bool = False  # lengths drawn in [S/8, S] (``make_case``), else S for every sequence

    @property
    def label(self) -> str:
        return case_label(self.B, self.H, self.fmt, self.varlen)


def case_label(B: int, H: int, fmt: str, varlen: bool = False) -> str:
    return f"B={B} H={H} {fmt}" + (" varlen" if varlen else "")


def format_case(B: int, H: int, S: int, fmt: str, seed: int = 0, varlen: bool = False) -> FormatCase:
    c = make_case(B, H, S, varlen=varlen, seed=seed)
    if fmt == "bf16":
        kv_cache, kv_scale, key, ref = c["cache"], torch.ones(1, device="cuda"), "cache", reference(c)
    elif fmt == "fp8_e4m3":
        kv_cache, k_scale = fp8_cache(c)
        kv_scale, key, ref = k_scale.reshape(1).float(), "cache_fp8", c["ref_fp8"]
    else:
        raise ValueError(f"format_case: fmt must be one of {sorted(DIRECT_PEERS)}, got {fmt!r}")
    return FormatCase(B, H, fmt, c, kv_cache, kv_scale, key, ref, c["lens"].cpu(), varlen)


def layer_caches(kv_cache: torch.Tensor, calls: int, budget: int = CACHE_COPIES_BYTES) -> list:
    """One cache per call, as each layer of a model has its own: ``kv_cache`` and copies of it. A step
    over one shared cache would find it in L2 from the previous call (all of it at B=1: 4.7 MB). Past
    ``budget`` the copies are reused in turn; each is then > budget / calls (~270 MB for 61 calls), far more
    than L2 holds."""
    size = kv_cache.numel() * kv_cache.element_size()
    copies = max(1, min(calls, budget // max(size, 1)))
    return [kv_cache] + [kv_cache.clone() for _ in range(copies - 1)]


def layer_queries(q: torch.Tensor, calls: int) -> list:
    """One query per call: ``q`` and ``calls - 1`` new ones of its distribution."""
    return [q] + [torch.randn_like(q, dtype=torch.float32).mul_(0.5).to(q.dtype) for _ in range(calls - 1)]


def back_to_back_inputs(case: FormatCase, calls: int, cache_budget: int = CACHE_COPIES_BYTES):
    """(queries, caches, peer entries) of ``calls`` calls back to back, as the attention calls of one model
    step: call i on query i and cache i % len(caches) (``layer_queries``, ``layer_caches``); the entries give
    ``direct_step`` the same pairs, query i with cache i, for i < len(caches)."""
    qs, caches = layer_queries(case.c["q"], calls), layer_caches(case.kv_cache, calls, cache_budget)
    return qs, caches, [{"q": qs[i], case.cache_key: cache} for i, cache in enumerate(caches)]


def sparse_case(B: int, H: int, S: int, topk: int, seed: int = 0) -> dict:
    """A dense case plus ``indices`` [B, topk]: random distinct slots of each sequence."""
    c = make_case(B, H, S, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    idx = torch.empty(B, topk, dtype=torch.int32)
    bt = c["block_table"].cpu()
    for b in range(B):
        pos = torch.randperm(S, generator=g)[:topk].sort().values
        idx[b] = (bt[b, pos // PAGE] * PAGE + pos % PAGE).int()
    c["indices"] = idx.cuda()
    return c


def sparse_reference(c: dict, cache: torch.Tensor) -> torch.Tensor:
    kv = cache.reshape(-1, D_QK).float()[c["indices"].long()]  # [B, topk, 576]
    s = torch.einsum("bhd,bkd->bhk", c["q"].float(), kv) * c["scale"]
    return torch.einsum("bhk,bkd->bhd", torch.softmax(s, -1), kv[..., :D_CKV])


# ----------------------------------------------------------------------------- dense peers

def _flashmla_dense(load, **extra):
    """A maker for FlashMLA's bf16 dense decode from the interface module ``load()`` returns."""

    def make(c: dict):
        fm = load()
        q, kc = c["q"].unsqueeze(1), c["cache"].unsqueeze(2)
        meta, _ = fm.get_mla_metadata()
        return lambda: fm.flash_mla_with_kvcache(q, kc, c["block_table"], c["lens"], D_CKV, meta, None,
                                                 softmax_scale=c["scale"], causal=False, **extra)[0].squeeze(1)

    return make


def peer_flashmla_fp8(c: dict):
    ops = _vllm_flashmla_fp8_ops()
    cache, k_scale = fp8_cache(c)
    q, q_scale = _fp8_query(c, cache, k_scale)
    md, splits = ops.get_mla_decoding_metadata_dense_fp8(c["lens"], c["H"], 1)
    kc = cache.unsqueeze(2)
    return lambda: ops.fwd_kvcache_mla_fp8(q, kc, D_CKV, c["lens"], c["block_table"], c["scale"], False, md, splits,
                                           q_scale, k_scale.reshape(1))[0].squeeze(1)


def peer_sgl_flashmla_fp8(c: dict):
    fm = _flash_mla()
    cache, k_scale = fp8_cache(c)
    q, q_scale = _fp8_query(c, cache, k_scale)
    meta, _ = fm.get_mla_metadata()
    meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
        c["lens"], c["H"], 1, is_fp8_kvcache=True, use_legacy=True)
    kc = cache.unsqueeze(2)
    return lambda: fm.flash_mla_with_kvcache(q, kc, c["block_table"], c["lens"], D_CKV, meta, None,
                                             softmax_scale=c["scale"], causal=False, is_fp8_kvcache=True,
                                             use_legacy=True, descale_q=q_scale,
                                             descale_k=k_scale.reshape(1))[0].squeeze(1)


def split_query(c: dict):
    """(q_nope, q_pe) as two contiguous tensors: ``c["q_nope"]`` / ``c["q_pe"]`` where the caller writes them
    (bench_pass --q-producer, in the timed step), else copies of ``c["q"]``'s slices made here, once."""
    if "q_nope" in c:
        return c["q_nope"], c["q_pe"]
    return c["q"][..., :D_CKV].contiguous(), c["q"][..., D_CKV:].contiguous()


_WORKSPACE: dict = {}


def _workspace() -> torch.Tensor:
    return _WORKSPACE.setdefault("ws", torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))


def peer_flashinfer(backend: str, fp8: bool = False):
    """A maker for FlashInfer's MLA wrapper (backend "fa2" or "fa3"), planned once, outside the timing."""

    def make(c: dict):
        fi = _flashinfer()
        w = fi.mla.BatchMLAPagedAttentionWrapper(_workspace(), backend=backend)
        B, page = c["B"], c["page"]
        npages = (c["lens"] + page - 1) // page
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
        kv_indptr[1:] = torch.cumsum(npages, 0)
        used = torch.arange(c["block_table"].shape[1], device="cuda")[None, :] < npages[:, None]
        qo_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        cache, scales = c["cache"], {}
        if fp8:
            cache, k_scale = fp8_cache(c)
            scales = dict(ckv_scale=float(k_scale), kpe_scale=float(k_scale))
        w.plan(qo_indptr, kv_indptr, c["block_table"][used].int(), c["lens"], c["H"], D_CKV, D_PE, page, False,
               c["scale"], torch.bfloat16, cache.dtype)
        ckv, kpe = cache[..., :D_CKV], cache[..., D_CKV:]
        qn, qp = split_query(c)
        out = torch.empty(B, c["H"], D_CKV, dtype=torch.bfloat16, device="cuda")
        return lambda: w.run(qn, qp, ckv, kpe, out=out, **scales)

    return make


def peer_vllm_triton(fp8: bool):
    """A maker for vLLM's Triton MLA decode (split count as vLLM picks it for the longest sequence)."""

    def make(c: dict):
        decode_attention_fwd = require("vllm.v1.attention.ops.triton_decode_attention",
                                       "pip install vllm").decode_attention_fwd
        import triton

        B, H = c["B"], c["H"]
        cache, k_scale = c["cache"], torch.tensor(1.0, device="cuda")
        if fp8:
            cache, k_scale = fp8_cache(c)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = min(triton.next_power_of_2(max(1, int(c["lens"].max()) // 512)), sms * 2)
        o = torch.zeros(B, H, D_CKV, dtype=torch.bfloat16, device="cuda")
        lse = torch.zeros(B, H, dtype=torch.bfloat16, device="cuda")
        logits = torch.empty(B, H, splits, D_CKV + 1, dtype=torch.float32, device="cuda")
        kb = cache.unsqueeze(2)

        def run():
            decode_attention_fwd(c["q"], kb, kb[..., :D_CKV], o, lse, c["block_table"], c["lens"], logits, splits,
                                 c["scale"], c["page"], k_scale=k_scale, v_scale=k_scale, is_mla=True)
            return o

        return run

    return make


PEERS = {
    "flashmla": _flashmla_dense(_vllm_flashmla),
    "flashinfer_fa2": peer_flashinfer("fa2"),
    "flashinfer_fa3": peer_flashinfer("fa3"),
    "flashinfer_fa2_fp8": peer_flashinfer("fa2", fp8=True),
    "flashinfer_fa3_fp8": peer_flashinfer("fa3", fp8=True),
    "flashmla_fp8": peer_flashmla_fp8,
    "sgl_flashmla": _flashmla_dense(_flash_mla, use_legacy=True),
    "sgl_flashmla_fp8": peer_sgl_flashmla_fp8,
    "vllm_triton_bf16": peer_vllm_triton(False),
    "vllm_triton_fp8": peer_vllm_triton(True),
}


# Where each dense peer reads its query from: the case entries a caller producing q in the timed step
# (bench_pass --q-producer) writes before each call. "q": [B, H, 576] in q's dtype, read in place;
# "q_nope" / "q_pe": two contiguous tensors; "q_fp8": [B, H, 576] float8_e4m3fn with ``c["q_scale"]``.
QUERY_ENTRIES = {
    "flashmla": ("q",), "sgl_flashmla": ("q",), "vllm_triton_bf16": ("q",), "vllm_triton_fp8": ("q",),
    "flashinfer_fa2": ("q_nope", "q_pe"), "flashinfer_fa3": ("q_nope", "q_pe"),
    "flashinfer_fa2_fp8": ("q_nope", "q_pe"), "flashinfer_fa3_fp8": ("q_nope", "q_pe"),
    "flashmla_fp8": ("q_fp8",), "sgl_flashmla_fp8": ("q_fp8",),
    "flashmla_sparse_fp8_all": ("q",), "sgl_flashmla_sparse_fp8_all": ("q",),
}


# The peers "the fastest peer's direct call" is the fastest of, per cache format of a dense call.
DIRECT_PEERS = {
    "bf16": ("sgl_flashmla", "flashmla", "flashinfer_fa3", "flashinfer_fa2"),
    "fp8_e4m3": ("sgl_flashmla_fp8", "flashmla_fp8", "flashinfer_fa3_fp8", "flashinfer_fa2_fp8"),
}
# Peers computing with q quantized to e4m3 (FlashMLA's dense FP8 kernel): about 10x the error of those keeping
# q in bf16 (FlashInfer's fp8 wrappers, our default), so a benchmark holds them against our op only where the
# caller opted into an e4m3 query too (``mla_inductor.allow_fp8_query``).
QUERY_IN_E4M3 = frozenset({"flashmla_fp8", "sgl_flashmla_fp8"})


@dataclass
class DirectStep:
    """A peer's direct calls back to back (``direct_step``): ``run()`` makes the step's calls, returning their
    outputs."""

    name: str
    run: Callable[[], list]
    first: torch.Tensor  # the first call's output, [B, H, 512]


def direct_step(name: str, c: dict, calls: int, layers: tuple = ({},), makers: Optional[dict] = None) -> DirectStep:
    """``calls`` direct calls of peer ``name`` back to back. Each call is the peer's own Python call (the
    function ``makers[name]``, by default ``PEERS[name]``, returns); its plan, schedule and quantized query are
    made when the step is made, once per entry of ``layers``, never in ``run()``. Call i reads ``c`` with the
    entries ``layers[i % len(layers)]`` in place of its own (e.g. its own ``q`` and cache). ``run()`` returns
    the step's outputs and does nothing else: what it costs is the peer's.

    The outputs stay alive until the step ends, as those of our op's step (``report.decode_calls``, which
    returns all of them): each call then writes its output to memory no other call of the step wrote. Dropped
    at once, the caching allocator hands a peer's next call the block its last call wrote, still in L2:
    2-3% faster at B=128 than the same calls keeping them (``bench_flashmla_schedule.py outputs``)."""
    make = (PEERS if makers is None else makers)[name]
    fns = [make(dict(c, **layer)) for layer in layers]
    first = fns[0]().reshape(c["B"], c["H"], D_CKV).clone()

    def run() -> list:
        return [fns[i % len(fns)]() for i in range(calls)]

    run()  # what a first step does once (lazy module loads, a first call's metadata) is not timed
    return DirectStep(name, run, first)


def direct_steps(names, c: dict, calls: int, layers: tuple = ({},), makers: Optional[dict] = None):
    """({peer: its ``direct_step``} for the peers of ``names`` that run here, {peer: why not} for the others:
    "not installed: ..." or "failed: ..."). A best peer is the best of those that ran: say which did not."""
    steps, not_timed = {}, {}
    for name in names:
        try:
            steps[name] = direct_step(name, c, calls, layers, makers)
        except PeerMissing as e:
            not_timed[name] = f"not installed: {e}"
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            not_timed[name] = f"failed: {type(e).__name__}: {str(e)[:160]}"
    return steps, not_timed


def fastest(times: dict) -> tuple:
    """(name, time) of the smallest time, (None, None) for none."""
    if not times:
        return None, None
    name = min(times, key=times.get)
    return name, times[name]


def peer_reference(name: str, c: dict) -> torch.Tensor:
    """The reference a dense peer's output is checked against (fp8 peers: on the dequantized inputs)."""
    if not name.endswith("fp8"):
        return c["ref"] if "ref" in c else reference(c)
    q_ref = c.pop("ref_fp8q", None)
    return c["ref_fp8"] if q_ref is None else q_ref


# ----------------------------------------------------------------------------- sparse peers

def _flashmla_sparse(load, **extra):
    """A maker for FlashMLA's sparse decode on the fp8_ds_mla cache (the interface module ``load()`` returns)."""

    def make(c: dict):
        fm = load()
        packed, deq = ds_mla_cache(c["cache"])
        c["ref_sparse"] = sparse_reference(c, deq)
        q, kc, idx = c["q"].unsqueeze(1), packed.unsqueeze(2), c["indices"].unsqueeze(1)
        meta, _ = fm.get_mla_metadata()
        return lambda: fm.flash_mla_with_kvcache(q, kc, None, None, D_CKV, meta, None, softmax_scale=c["scale"],
                                                 causal=False, is_fp8_kvcache=True, indices=idx,
                                                 **extra)[0].squeeze(1)

    return make


def dense_slots(c: dict) -> torch.Tensor:
    """int32 [B, 1, K]: every position of each sequence as a top-k slot (page * PAGE + offset), -1 past its
    length; K = the block table's capacity (a multiple of 64, as FlashMLA's sparse kernel needs)."""
    B, max_pages = c["block_table"].shape
    positions = torch.arange(max_pages * PAGE, device="cuda")
    slots = c["block_table"].long()[:, positions // PAGE] * PAGE + positions % PAGE
    return torch.where(positions[None, :] < c["lens"][:, None].long(), slots, -1).int().unsqueeze(1)


def _flashmla_dense_ds(load, **extra):
    """A maker for a dense call on the fp8_ds_mla cache (``c["cache_ds"]``) through FlashMLA's sparse kernel,
    every position of each sequence an index (the recipe our dense fp8_ds_mla rows use)."""

    def make(c: dict):
        fm = load()
        q, kc, idx = c["q"].unsqueeze(1), c["cache_ds"].unsqueeze(2), dense_slots(c)
        meta, _ = fm.get_mla_metadata()
        return lambda: fm.flash_mla_with_kvcache(q, kc, None, None, D_CKV, meta, None, softmax_scale=c["scale"],
                                                 causal=False, is_fp8_kvcache=True, indices=idx,
                                                 **extra)[0].squeeze(1)

    return make


def peer_flashinfer_sparse(c: dict):
    """vLLM's SM90 FlashInfer sparse recipe: page_size 1, the top-k slots as the page list (bf16 cache)."""
    fi = _flashinfer()
    c["ref_sparse"] = sparse_reference(c, c["cache"])
    w = fi.mla.BatchMLAPagedAttentionWrapper(_workspace(), backend="fa3")
    B, topk = c["indices"].shape
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * topk
    lens = torch.full((B,), topk, dtype=torch.int32, device="cuda")
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    w.plan(qo_indptr, kv_indptr, c["indices"].reshape(-1), lens, c["H"], D_CKV, D_PE, 1, False, c["scale"],
           torch.bfloat16, torch.bfloat16)
    flat = c["cache"].reshape(-1, 1, D_QK)
    qn, qp = c["q"][..., :D_CKV].contiguous(), c["q"][..., D_CKV:].contiguous()
    out = torch.empty(B, c["H"], D_CKV, dtype=torch.bfloat16, device="cuda")
    return lambda: w.run(qn, qp, flat[..., :D_CKV], flat[..., D_CKV:], out=out)


SPARSE_PEERS = {"flashmla_sparse_fp8": _flashmla_sparse(_vllm_flashmla),
                "flashinfer_fa3_sparse": peer_flashinfer_sparse,
                "sgl_flashmla_sparse_fp8": _flashmla_sparse(_flash_mla, use_legacy=True)}

# Dense calls on the fp8_ds_mla cache: FlashMLA's sparse kernel given every position, from either build.
DENSE_DS_PEERS = {"flashmla_sparse_fp8_all": _flashmla_dense_ds(_vllm_flashmla),
                  "sgl_flashmla_sparse_fp8_all": _flashmla_dense_ds(_flash_mla, use_legacy=True)}
