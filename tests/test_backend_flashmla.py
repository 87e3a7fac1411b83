"""Tests of the FlashMLA backend (mla_inductor/backends/flashmla.py).

CPU (CI): the supports() matrix per GPU generation, provider discovery with fake modules, and the
argument marshalling through recording fake providers (shapes, views, causal flag, metadata hand-over,
lse layout, masking of rows that see nothing, FP8 query quantization).
GPU (``-m gpu``, H100): every kernel against ``paged_decode_reference`` on fresh random inputs with the
caching allocator poisoned with NaN first (FlashMLA allocates its own outputs: an unwritten element
would show up as NaN); the Inductor path (generated code calls our ops, one plan for two layers); and
CUDA-graph replays with seq_lens changed in place between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import mla_inductor
from mla_inductor.backends import flashmla as fm
from mla_inductor.backends import registered_backends
from mla_inductor.backends._common import quantize_query_fp8, quantize_query_reference
from mla_inductor.contract import DecodeProblem
from mla_inductor.reference import paged_decode_reference
from mla_inductor.testing import TOLERANCE, make_decode_inputs, relative_error
from triton_support import needs_triton

BACKEND = fm.BACKEND


# ----------------------------------------------------------------------------- fake providers

@dataclass
class FakeSchedMeta:
    """Stands in for FlashMLASchedMeta (2026 interface)."""

    have_initialized: bool = False
    config: object = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def _fake_outputs(q: torch.Tensor, dtype=None):
    """out [B, Q, H, 512] and lse [B, H, Q] whose values encode (b, j, h), to check the layout change."""
    B, Q, H, _ = q.shape
    code = (torch.arange(B)[:, None, None] * 8 + torch.arange(Q)[None, :, None] * 4
            + torch.arange(H)[None, None, :]).float()  # [B, Q, H]; small integers: exact in bf16 (H <= 4, Q <= 2)
    out = code[..., None].expand(B, Q, H, 512).to(dtype or q.dtype).contiguous()
    lse = code.transpose(1, 2).contiguous()  # [B, H, Q]
    return out, lse


def _define_sched_meta(module: types.ModuleType) -> None:
    """Put FakeSchedMeta where the real module has FlashMLASchedMeta: vLLM's interface module defines it
    itself; a ``flash_mla`` package (sgl-flash-mla, DeepSeek's) does not export it from ``__init__``, only
    from its ``flash_mla_interface`` submodule (an attribute of the package once imported)."""
    if module.__name__ == "flash_mla":
        module.__path__ = []  # a package, like the real one
        module.flash_mla_interface = types.ModuleType("flash_mla.flash_mla_interface")
        module.flash_mla_interface.FlashMLASchedMeta = FakeSchedMeta
    else:
        module.FlashMLASchedMeta = FakeSchedMeta


class RecordingInterface(types.ModuleType):
    """A provider module recording every call; ``sched_meta=True`` mimics the 2026 interface."""

    def __init__(self, name="flash_mla", sched_meta=True, legacy_topk=True):
        super().__init__(name)
        self.calls = []
        if sched_meta:
            _define_sched_meta(self)

            def get_mla_metadata(*args, **kwargs):
                return FakeSchedMeta(), None
        elif legacy_topk:
            def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                                 is_fp8_kvcache=False, topk=None):
                self.calls.append(("get_mla_metadata", (cache_seqlens, num_q_tokens_per_head_k, num_heads_k),
                                   dict(num_heads_q=num_heads_q, is_fp8_kvcache=is_fp8_kvcache, topk=topk)))
                return torch.full((4, 8), 7, dtype=torch.int32), torch.zeros(cache_seqlens.shape[0] + 1,
                                                                                 dtype=torch.int32)
        else:
            def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
                return torch.zeros(4, 8, dtype=torch.int32), torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)
        self.get_mla_metadata = get_mla_metadata

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                               indices=None):
        self.calls.append(("flash_mla_with_kvcache", (q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                      tile_scheduler_metadata, num_splits),
                           dict(softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=is_fp8_kvcache,
                                indices=indices)))
        if isinstance(tile_scheduler_metadata, FakeSchedMeta) and tile_scheduler_metadata.tile_scheduler_metadata is None:
            tile_scheduler_metadata.tile_scheduler_metadata = torch.full((4, 8), 3, dtype=torch.int32)
            tile_scheduler_metadata.num_splits = torch.zeros(q.shape[0] + 1, dtype=torch.int32)
        return _kernel_outputs(q, cache_seqlens, indices)


def _kernel_outputs(q, cache_seqlens, indices, zero_empty=True):
    out, lse = _fake_outputs(q, torch.bfloat16 if q.dtype == torch.float8_e4m3fn else None)
    if not zero_empty:  # like the FP8 kernel fed lengths >= 1: empty rows hold real (unwanted) values
        return out, lse
    if indices is None:  # like FlashMLA's dense kernel: out 0 (lse +inf) where a row sees nothing
        Q = q.shape[1]
        empty = cache_seqlens[:, None] - Q + torch.arange(Q)[None, :] < 0  # [B, Q]
    else:  # like FlashMLA's sparse kernel: the same for an all -1 row
        empty = (indices < 0).all(-1)
    out[empty] = 0
    lse.transpose(1, 2)[empty] = float("inf")
    return out, lse


class RecordingSglModule(types.ModuleType):
    """Mimics the sgl-flash-mla wheel's ``flash_mla``: the 2026 ``FlashMLASchedMeta`` interface plus
    ``use_legacy``, ``descale_q/descale_k`` and the hoisted ``get_mla_decoding_metadata``. Like the real
    one, dense fp8 refuses to run without metadata, nothing runs without ``use_legacy=True``, and
    ``FlashMLASchedMeta`` is not exported at top level (only from ``flash_mla.flash_mla_interface``)."""

    __version__ = "1.0.0"

    def __init__(self, name="flash_mla", legacy=True):
        super().__init__(name)
        self.calls = []
        self.legacy = legacy
        _define_sched_meta(self)

    def has_legacy(self):
        return self.legacy

    def get_mla_metadata(self, *args, **kwargs):
        return FakeSchedMeta(), None

    def get_mla_decoding_metadata(self, seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False,
                                  topk=None, use_legacy=False):
        self.calls.append(("get_mla_decoding_metadata", (seqlens_k, num_q_tokens_per_head_k, h_k, h_q),
                           dict(is_fp8_kvcache=is_fp8_kvcache, topk=topk, use_legacy=use_legacy)))
        return torch.full((4, 8), 9, dtype=torch.int32), torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None, enable_batch_invariant=False, use_legacy=False,
                               kv_format=None, descale_q=None, descale_k=None):
        assert use_legacy, "pass use_legacy=True"
        assert isinstance(tile_scheduler_metadata, FakeSchedMeta) and num_splits is None
        dense_fp8 = bool(is_fp8_kvcache) and indices is None
        if dense_fp8:
            assert tile_scheduler_metadata.tile_scheduler_metadata is not None, "dense fp8 needs metadata"
        scheduled = tile_scheduler_metadata.tile_scheduler_metadata is not None
        self.calls.append(("flash_mla_with_kvcache", (q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                      tile_scheduler_metadata),
                           dict(softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=is_fp8_kvcache,
                                indices=indices, descale_q=descale_q, descale_k=descale_k, scheduled=scheduled)))
        if not scheduled:  # like the real call: the kernel makes the schedule and leaves it in the holder
            tile_scheduler_metadata.tile_scheduler_metadata = torch.full((4, 8), 7, dtype=torch.int32)
            tile_scheduler_metadata.num_splits = torch.zeros(q.shape[0] + 1, dtype=torch.int32)
        return _kernel_outputs(q, cache_seqlens, indices, zero_empty=not dense_fp8)


class RecordingFP8Ops:
    def __init__(self):
        self.calls = []

    def get_mla_decoding_metadata_dense_fp8(self, seq_lens, num_heads_per_head_k, num_heads_k):
        self.calls.append(("metadata", seq_lens, num_heads_per_head_k, num_heads_k))
        return [torch.full((4, 8), 5, dtype=torch.int32), torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)]

    def fwd_kvcache_mla_fp8(self, q, kcache, head_dim_v, seq_lens, block_table, scale, causal, md, splits,
                            descale_q, descale_k):
        self.calls.append(("fwd", q, kcache, head_dim_v, seq_lens, block_table, scale, causal, md, splits,
                           descale_q, descale_k))
        return list(_fake_outputs(q, torch.bfloat16))


def _providers(interface=None, fp8_ops=None, name="fake") -> fm.Providers:
    """Providers made from fake modules, as discovery would make them (interface first, FP8 extension next)."""
    found = []
    if interface is not None:
        found.append(fm.interface_provider(name, interface, []))
    if fp8_ops is not None:
        found.append(fm.FP8ExtensionFlashMLA(fm.FP8_EXTENSION_MODULE, types.ModuleType("fp8"), fp8_ops))
    return fm.Providers(tuple(p for p in found if p is not None))


@pytest.fixture
def provider(monkeypatch):
    """Install recording providers in place of discovery."""
    def install(interface=None, fp8_ops=None, name="fake"):
        providers = _providers(interface, fp8_ops, name)
        monkeypatch.setattr(fm, "find_providers", lambda: providers)
        return providers
    return install


def _problem(**overrides) -> DecodeProblem:
    base = dict(device_type="cuda", cache_format="bf16", q_dtype=torch.bfloat16, num_heads=16, kv_lora_rank=512,
                rope_dim=64, page_size=64, sparse=False, topk=None, q_per_seq=1)
    base.update(overrides)
    return DecodeProblem(**base)


# ----------------------------------------------------------------------------- supports()

DENSE = _problem()
DENSE_FP16 = _problem(cache_format="fp16", q_dtype=torch.float16)
FP8 = _problem(cache_format="fp8_e4m3", num_heads=128, q_per_seq=2, fp8_query=True)
FP8_NOT_OPTED_IN = _problem(cache_format="fp8_e4m3", num_heads=128, q_per_seq=2)
SPARSE = _problem(cache_format="fp8_ds_mla", num_heads=128, sparse=True, topk=2048)
SPARSE_H64 = _problem(cache_format="fp8_ds_mla", num_heads=64, sparse=True, topk=100)
DENSE_DS = _problem(cache_format="fp8_ds_mla", num_heads=128, q_per_seq=2)
DENSE_DS_H16 = _problem(cache_format="fp8_ds_mla", num_heads=16)
PROBLEMS = dict(DENSE=DENSE, DENSE_FP16=DENSE_FP16, FP8=FP8, FP8_NOT_OPTED_IN=FP8_NOT_OPTED_IN, SPARSE=SPARSE,
                SPARSE_H64=SPARSE_H64, DENSE_DS=DENSE_DS, DENSE_DS_H16=DENSE_DS_H16)

# capability -> which of the problems above are accepted
MATRIX = {
    None: set(),
    (8, 0): set(),
    (8, 9): set(),
    (9, 0): {"DENSE", "DENSE_FP16", "FP8", "SPARSE", "SPARSE_H64", "DENSE_DS"},
    (10, 0): {"SPARSE", "SPARSE_H64", "DENSE_DS"},
    (12, 0): set(),
}


@pytest.mark.parametrize("capability", list(MATRIX), ids=lambda c: "CPU" if c is None else f"SM{c[0]}{c[1]}")
def test_supports_matrix(provider, capability):
    provider(RecordingSglModule())
    for name, problem in PROBLEMS.items():
        if capability is None:
            problem = _problem(**{**problem.__dict__, "device_type": "cpu"})
        reason = BACKEND.supports(problem, capability)
        assert (reason is None) == (name in MATRIX[capability]), (name, capability, reason)
        if reason is not None:
            assert isinstance(reason, str) and reason


@pytest.mark.parametrize("overrides, expected", [
    (dict(page_size=16), "page_size 64, got 16"),
    (dict(page_size=None), "page_size 64, got a symbolic one"),
    (dict(kv_lora_rank=256), "kv_lora_rank=512 and rope_dim=64"),
    (dict(rope_dim=32), "got 512 and 32"),
    (dict(cache_format="fp32", q_dtype=torch.float32), "bf16, fp16, fp8_e4m3 or fp8_ds_mla cache, got fp32"),
    (dict(q_dtype=torch.float16), "queries of the cache's dtype (bf16), got torch.float16"),
    (dict(cache_format="fp8_ds_mla"), "dense decode of an fp8_ds_mla cache (its sparse kernel) needs 64 or 128 "
                                      "heads, got 16"),
    (dict(cache_format="fp8_ds_mla", num_heads=64, q_dtype=torch.float16), "needs bf16 queries, got torch.float16"),
    (dict(sparse=True, topk=64), "sparse decode needs the fp8_ds_mla cache, got bf16"),
    (dict(cache_format="fp8_ds_mla", sparse=True, topk=64, num_heads=16), "64 or 128 heads, got 16"),
    (dict(num_heads=None), "static num_heads and Q"),
    (dict(q_per_seq=None), "static num_heads and Q"),
    (dict(cache_format="fp8_ds_mla", sparse=True, topk=None, num_heads=64), "static top-k width"),
    (dict(cache_format="fp8_ds_mla", sparse=True, topk=64, num_heads=64, q_dtype=torch.float16),
     "bf16 queries, got torch.float16"),
    (dict(cache_format="fp8_e4m3", q_dtype=torch.float32, fp8_query=True), "bf16 or fp16 queries, got torch.float32"),
    (dict(cache_format="fp8_e4m3"), "computes with q in e4m3"),
])
def test_supports_reasons_are_precise(provider, overrides, expected):
    provider(RecordingSglModule())
    reason = BACKEND.supports(_problem(**overrides), (9, 0))
    assert reason is not None and expected in reason, reason


def test_dense_fp8_is_opt_in():
    """Accuracy is the caller's choice: FlashMLA's dense FP8 kernel (q in e4m3) takes an fp8 call only with
    a static q_scale on it or under allow_fp8_query; otherwise the table's next backend keeps q in bf16."""
    from mla_inductor.info import example_problem
    from mla_inductor.selection import FP8_QUERY_ENV, select_backend

    everything = {name: None for name in registered_backends()}
    problem = example_problem("cuda", "fp8_e4m3", False, 128, 64)
    chosen = lambda: select_backend(problem, (9, 0), available=everything, preference=()).backend  # noqa: E731
    assert chosen() == "triton"
    with mla_inductor.allow_fp8_query():
        assert chosen() == "flashmla"
        with mla_inductor.allow_fp8_query(False):
            assert chosen() == "triton"
    with_scale = dataclasses.replace(problem, fp8_query=True)  # what check_decode_args makes of a q_scale
    assert select_backend(with_scale, (9, 0), available=everything, preference=()).backend == "flashmla"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FP8_QUERY_ENV, "1")
        assert chosen() == "flashmla"


def test_supports_names_missing_provider_parts(provider):
    provider(RecordingInterface(), None, name="flash_mla")  # the 2026 interface: no dense FP8 kernel
    assert "no installed FlashMLA provider has the dense fp8_e4m3 kernel" in BACKEND.supports(FP8, (9, 0))
    assert BACKEND.supports(DENSE_DS, (9, 0)) is None
    provider(None, RecordingFP8Ops())
    assert "has the dense bf16/fp16 kernel" in BACKEND.supports(DENSE, (9, 0))
    assert "has the sparse fp8_ds_mla kernel" in BACKEND.supports(SPARSE, (9, 0))
    provider(RecordingInterface(sched_meta=False, legacy_topk=False), None, name="old")
    assert "has the sparse fp8_ds_mla kernel" in BACKEND.supports(SPARSE, (9, 0))
    assert BACKEND.supports(DENSE, (9, 0)) is None


# ----------------------------------------------------------------------------- discovery: which provider, in which order

ALL_MODULES = fm.INTERFACE_MODULES + (fm.FP8_EXTENSION_MODULE,)


@pytest.fixture
def fresh_discovery(monkeypatch):
    """Every provider module absent (None in sys.modules: its import fails) until a test installs a fake."""
    fm.find_providers.cache_clear()
    for name in ALL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    yield monkeypatch
    fm.find_providers.cache_clear()


def _install_vllm(mp, fp8=True):
    interface = RecordingInterface(fm.VLLM_INTERFACE)
    mp.setitem(sys.modules, fm.VLLM_INTERFACE, interface)
    ops = None
    if fp8:
        ops = RecordingFP8Ops()
        mp.setitem(sys.modules, fm.FP8_EXTENSION_MODULE, types.ModuleType(fm.FP8_EXTENSION_MODULE))
        mp.setattr(torch.ops, "_flashmla_extension_C", ops, raising=False)
    return interface, ops


def _sources(providers: fm.Providers) -> dict[str, str]:
    return {mode: providers.for_mode(mode).name for mode in fm.MODES if providers.for_mode(mode) is not None}


def test_discovery_nothing_installed(fresh_discovery):
    providers = fm.find_providers()
    assert providers.found == ()
    reason = BACKEND.unavailable_reason()
    for name in ALL_MODULES:
        assert name in reason
    # supports() judges the call alone (docs/backends.md is machine-independent); availability is separate
    assert BACKEND.supports(DENSE, (9, 0)) is None
    assert BACKEND.loaded_from() is None


def test_sgl_flash_mla_comes_first_and_vllm_is_not_imported(fresh_discovery):
    """sgl-flash-mla serves every mode: vLLM (installed too) is neither imported nor used."""
    sgl = RecordingSglModule()
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, sgl)
    imported = []

    class Watch(types.ModuleType):
        def __getattr__(self, attr):
            imported.append(attr)
            raise AttributeError(attr)

    for name in (fm.VLLM_INTERFACE, fm.FP8_EXTENSION_MODULE, fm.OLD_VLLM_INTERFACE):
        fresh_discovery.setitem(sys.modules, name, Watch(name))
    providers = fm.find_providers()
    assert _sources(providers) == dict.fromkeys(fm.MODES, fm.SGL_MODULE)
    assert isinstance(providers.found[0], fm.SglFlashMLA) and len(providers.found) == 1 and not imported
    assert "vllm" not in providers.tried
    assert BACKEND.decode_and_plan_op() is None  # every schedule is made by the metadata function
    assert BACKEND.loaded_from() == ("dense bf16/fp16, dense fp8_e4m3, sparse fp8_ds_mla, dense fp8_ds_mla (sparse "
                                     "kernel) from flash_mla 1.0.0")


def test_vllm_build_is_the_fallback(fresh_discovery):
    """No flash_mla: vLLM's interface serves dense / sparse / dense_ds, its FP8 extension dense_fp8; their
    2026 interface makes schedules only inside a kernel call, so the first layer's decode makes it."""
    interface, ops = _install_vllm(fresh_discovery)
    providers = fm.find_providers()
    assert _sources(providers) == {"dense": fm.VLLM_INTERFACE, "sparse": fm.VLLM_INTERFACE,
                                   "dense_ds": fm.VLLM_INTERFACE, "dense_fp8": fm.FP8_EXTENSION_MODULE}
    assert providers.found[1].ops is ops and f"{fm.SGL_MODULE}: " in providers.tried
    assert BACKEND.decode_and_plan_op() is fm.DECODE_AND_PLAN_OP


def test_sgl_wheel_layout_sched_meta_only_in_its_interface_submodule(fresh_discovery):
    """The real wheel's __init__ exports no FlashMLASchedMeta (flash_mla_interface defines it, and
    flash_mla_with_kvcache asserts isinstance of that class): the provider must find it there."""
    sgl = RecordingSglModule()
    assert not hasattr(sgl, "FlashMLASchedMeta") and sgl.flash_mla_interface.FlashMLASchedMeta is FakeSchedMeta
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, sgl)
    (provider,) = fm.find_providers().found
    assert isinstance(provider, fm.SglFlashMLA) and provider.sched_meta is FakeSchedMeta
    # DeepSeek's own 2026 package has the same layout: still recognised as the 2026 interface
    assert isinstance(fm.interface_provider(fm.SGL_MODULE, RecordingInterface(fm.SGL_MODULE), []),
                      fm.SchedMetaFlashMLA)


def test_sgl_like_module_without_sched_meta_is_refused(fresh_discovery):
    sgl = RecordingSglModule()
    del sgl.flash_mla_interface
    sgl.__path__ = []  # a package whose flash_mla_interface does not import
    tried = []
    assert fm.interface_provider(fm.SGL_MODULE, sgl, tried) is None
    assert "no FlashMLASchedMeta" in tried[0]


def test_sgl_wheel_without_legacy_kernels_falls_back_to_vllm(fresh_discovery):
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, RecordingSglModule(legacy=False))
    _install_vllm(fresh_discovery)
    providers = fm.find_providers()
    assert set(_sources(providers).values()) == {fm.VLLM_INTERFACE, fm.FP8_EXTENSION_MODULE}
    assert "flash_mla: built without its legacy" in providers.tried


def test_deepseek_2026_package_then_vllm_fp8_extension(fresh_discovery):
    """DeepSeek's own flash_mla (2026 interface: no dense FP8) serves what it has; the FP8 extension is
    imported for dense_fp8 only."""
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, RecordingInterface(fm.SGL_MODULE))
    _install_vllm(fresh_discovery)
    providers = fm.find_providers()
    assert _sources(providers) == {"dense": fm.SGL_MODULE, "sparse": fm.SGL_MODULE, "dense_ds": fm.SGL_MODULE,
                                   "dense_fp8": fm.FP8_EXTENSION_MODULE}
    assert isinstance(providers.found[0], fm.SchedMetaFlashMLA)
    assert [p.name for p in providers.found] == [fm.SGL_MODULE, fm.FP8_EXTENSION_MODULE]  # vLLM's interface unused


def test_legacy_interface_styles(fresh_discovery):
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, RecordingInterface(fm.SGL_MODULE, sched_meta=False))
    providers = fm.find_providers()
    assert isinstance(providers.found[0], fm.LegacyFlashMLA) and providers.found[0].modes == {"dense", "sparse",
                                                                                            "dense_ds"}
    fm.find_providers.cache_clear()
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, RecordingInterface(fm.SGL_MODULE, sched_meta=False,
                                                                           legacy_topk=False))
    assert fm.find_providers().found[0].modes == {"dense"}


def test_unrelated_flash_mla_module_is_skipped(fresh_discovery):
    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, types.ModuleType(fm.SGL_MODULE))
    interface, _ = _install_vllm(fresh_discovery, fp8=False)
    providers = fm.find_providers()
    assert providers.for_mode("dense").module is interface
    assert "flash_mla: has no flash_mla_with_kvcache" in providers.tried


def test_info_shows_where_flashmla_was_loaded_from(fresh_discovery):
    from mla_inductor.info import report

    fresh_discovery.setitem(sys.modules, fm.SGL_MODULE, RecordingSglModule())
    assert "flashmla kernels: dense bf16/fp16, dense fp8_e4m3, sparse fp8_ds_mla, dense fp8_ds_mla (sparse kernel) " \
           "from flash_mla 1.0.0" in report()


def test_pass_cache_key_follows_the_flashmla_provider(monkeypatch):
    """sgl-flash-mla and vLLM's build get different graphs (a plan op vs decode_and_plan, their own
    schedule shapes): a graph compiled against one must not be served from Inductor's caches for the other
    (it was, on the H100: the vLLM run replayed the sgl-flash-mla graph)."""
    from mla_inductor.lowering.graph_pass import MLALoweringPass

    monkeypatch.setattr(fm.FlashMLABackend, "unavailable_reason", lambda self: None)
    sgl_providers = _providers(RecordingSglModule(), name=fm.SGL_MODULE)
    vllm_providers = _providers(RecordingInterface(fm.VLLM_INTERFACE), RecordingFP8Ops(), name=fm.VLLM_INTERFACE)
    ours = MLALoweringPass()
    monkeypatch.setattr(fm, "find_providers", lambda: sgl_providers)
    with_sgl = ours.uuid()
    assert with_sgl == ours.uuid()
    monkeypatch.setattr(fm, "find_providers", lambda: vllm_providers)
    assert ours.uuid() != with_sgl


def test_import_is_lazy():
    code = ("import sys, mla_inductor, mla_inductor.backends.flashmla; "
            "bad = [m for m in ('vllm', 'flash_mla') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- marshalling (CPU)

SEQ_LENS = [0, 1, 63, 64, 65, 130]


def _expected_rows(seq_lens, Q, H, sparse=None):
    """Per row: the fake kernel's (b, j, h) code where the row sees something, else None."""
    rows = []
    for b, n in enumerate(seq_lens):
        for j in range(Q):
            t = b * Q + j
            valid = bool((sparse[t] >= 0).any()) if sparse is not None else n - Q + j >= 0
            rows.append([b * 8 + j * 4 + h if valid else None for h in range(H)])
    return rows


def _check_layout(out, lse, rows):
    for t, row in enumerate(rows):
        for h, code in enumerate(row):
            if code is None:
                assert float(lse[t, h]) == float("-inf") and bool((out[t, h] == 0).all())
            else:
                assert float(lse[t, h]) == code and bool((out[t, h].float() == code).all()), (t, h)


@pytest.mark.parametrize("Q", [1, 2])
def test_dense_marshalling_2026_interface(provider, Q):
    interface = RecordingInterface()
    provider(interface)
    H = 3
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q)
    out, lse = BACKEND.decode(*x.args())
    assert out.shape == (len(SEQ_LENS) * Q, H, 512) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H))
    (name, args, kwargs), = interface.calls
    q, kcache, table, lens, dv, meta, splits = args
    B = len(SEQ_LENS)
    torch.testing.assert_close(q, torch.cat([x.q_nope, x.q_pe], -1).view(B, Q, H, 576), rtol=0, atol=0)
    assert kcache.shape == (x.kv_cache.shape[0], 64, 1, 576) and kcache.data_ptr() == x.kv_cache.data_ptr()
    assert table.dtype == torch.int32 and bool((table >= 0).all())
    used = x.block_table >= 0
    assert torch.equal(table[used], x.block_table[used])
    assert lens is x.seq_lens and dv == 512 and splits is None
    assert isinstance(meta, FakeSchedMeta) and meta.tile_scheduler_metadata is not None  # made by the kernel
    assert kwargs == dict(softmax_scale=x.softmax_scale, causal=Q > 1, is_fp8_kvcache=False, indices=None)


def test_query_slices_of_one_row_are_not_copied(provider):
    interface = RecordingInterface()
    provider(interface)
    x = make_decode_inputs([5, 70], num_heads=2, q_per_seq=2)
    q = torch.randn(4, 2, 576 + 8).to(torch.bfloat16)  # padded rows, as a model's projection might leave them
    BACKEND.decode(q[..., :512], q[..., 512:576], *x.args()[2:])
    kernel_q = interface.calls[0][1][0]
    assert kernel_q.data_ptr() == q.data_ptr() and kernel_q.shape == (2, 2, 2, 576)
    torch.testing.assert_close(kernel_q.reshape(4, 2, 576), q[..., :576], rtol=0, atol=0)


def test_plan_is_handed_to_the_kernel(provider):
    interface = RecordingInterface()
    provider(interface)
    x = make_decode_inputs([5, 70], num_heads=2, q_per_seq=2)
    plan = torch.ops.mla_flashmla.plan(*x.args())
    md, splits, counts, table = plan
    assert md.shape == (4, 8) and splits.shape == (3,) and counts.tolist() == [4, 5, 69, 70]  # keys per row
    assert bool((table >= 0).all())
    interface.calls.clear()
    out, lse = torch.ops.mla_flashmla.decode(*x.args(), plan)
    meta = interface.calls[0][1][5]
    assert meta.tile_scheduler_metadata is md and meta.num_splits is splits
    assert interface.calls[0][1][2] is table


DECODE_AND_PLAN = fm.decode_and_plan


@pytest.mark.parametrize("Q", [1, 2])
def test_decode_out_hands_its_plan_to_the_kernel(provider, monkeypatch, Q):
    """mla_flashmla::decode_out (a compiled mla.paged_decode) on a bf16 cache: given the graph's plan, one kernel
    call on that schedule and clamped table, without the general path; given none, it schedules itself through
    the general path. Both give the contract's out."""
    interface = RecordingInterface()
    provider(interface)
    general = []  # calls that took the general path (decode_and_plan, attend_rows)
    monkeypatch.setattr(fm, "decode_and_plan", lambda *a, **k: general.append(1) or DECODE_AND_PLAN(*a, **k))
    H = 3
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q)
    plan = torch.ops.mla_flashmla.plan(*x.args())
    interface.calls.clear()
    planned = torch.ops.mla_flashmla.decode_out(*x.args(), plan)
    assert not general
    (_, handed, kwargs), = interface.calls
    assert handed[5].tile_scheduler_metadata is plan[0] and handed[5].num_splits is plan[1] and handed[2] is plan[3]
    assert handed[3] is x.seq_lens and kwargs["causal"] == (Q > 1)
    alone = torch.ops.mla_flashmla.decode_out(*x.args(), [])
    assert len(general) == 1
    assert planned.shape == alone.shape == (len(SEQ_LENS) * Q, H, 512) and torch.equal(planned, alone)
    for t, row in enumerate(_expected_rows(SEQ_LENS, Q, H)):
        for h, code in enumerate(row):
            assert bool((planned[t, h].float() == (0 if code is None else code)).all()), (t, h)


DECODE_REUSING_PLANS = fm.decode_reusing_plans


@pytest.mark.parametrize("Q", [1, 2])
def test_eager_calls_after_a_steps_first_go_from_the_stored_plan_to_the_kernel(provider, monkeypatch, Q):
    """An eager mla.paged_decode on a bf16 cache: the step's first call plans (here: the 2026 interface's kernel
    call makes the schedule), the others hand that schedule and clamped table straight to the kernel, and give
    the first call's result; a write of seq_lens makes the next call plan again."""
    interface = RecordingInterface()
    provider(interface)
    fm.PLANS.forget()
    general = []  # calls that took the general path (plan lookup, decode_and_plan, attend_rows)
    monkeypatch.setattr(fm, "decode_reusing_plans", lambda *a, **k: general.append(1) or DECODE_REUSING_PLANS(*a, **k))
    H = 3
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q)
    args = (*x.args(), None)
    run = BACKEND.eager_decode(_problem(num_heads=H, q_per_seq=Q), args, with_lse=False)
    first, second = run(*args), run(*args)
    assert len(interface.calls) == 2 and len(general) == 1
    (_, made, kwargs1), (_, reused, kwargs2) = interface.calls
    assert reused[5].tile_scheduler_metadata is made[5].tile_scheduler_metadata  # the stored schedule
    assert reused[5].num_splits is made[5].num_splits and reused[2] is made[2]  # and the stored clamped table
    assert reused[3] is x.seq_lens and kwargs2 == kwargs1 == dict(softmax_scale=x.softmax_scale, causal=Q > 1,
                                                                   is_fp8_kvcache=False, indices=None)
    torch.testing.assert_close(reused[0], torch.cat([x.q_nope, x.q_pe], -1).view(len(SEQ_LENS), Q, H, 576),
                               rtol=0, atol=0)
    assert second.shape == (len(SEQ_LENS) * Q, H, 512) and torch.equal(first, second)
    rows = _expected_rows(SEQ_LENS, Q, H)
    for t, row in enumerate(rows):
        for h, code in enumerate(row):
            assert bool((second[t, h].float() == (0 if code is None else code)).all()), (t, h)
    x.seq_lens.copy_(x.seq_lens)  # written: the next call plans again (a fresh schedule from its kernel call)
    run(*args)
    assert len(general) == 2 and interface.calls[2][1][5].tile_scheduler_metadata is not made[5].tile_scheduler_metadata


@pytest.mark.parametrize("interface_kind", ["2026", "legacy", "fp8"])
def test_decode_and_plan_returns_the_schedule_it_ran_with(provider, interface_kind):
    """The first layer's op: its plan is what its own kernel call scheduled with, and later layers
    handed that plan get the same result as the first."""
    if interface_kind == "fp8":
        ops = RecordingFP8Ops()
        provider(None, ops)
        x = make_decode_inputs([5, 70], num_heads=2, q_per_seq=2, fmt="fp8_e4m3")
        made = lambda: ops.calls[-1][8]  # noqa: E731  md passed to fwd_kvcache_mla_fp8
    else:
        interface = RecordingInterface(sched_meta=interface_kind == "2026")
        provider(interface)
        x = make_decode_inputs([5, 70], num_heads=2, q_per_seq=2)
        made = lambda: (interface.calls[-1][1][5].tile_scheduler_metadata  # noqa: E731
                        if interface_kind == "2026" else interface.calls[-1][1][5])
    out, lse, *plan = torch.ops.mla_flashmla.decode_and_plan(*x.args())
    assert torch.equal(plan[0], made())
    assert len(plan) == len(torch.ops.mla_flashmla.plan(*x.args()))
    again, again_lse = torch.ops.mla_flashmla.decode(*x.args(), plan)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)
    # test_schema perturbs inputs with arithmetic CPU float8 lacks; the fp8 case checks the fake impl only.
    torch.library.opcheck(torch.ops.mla_flashmla.decode_and_plan.default, x.args(),
                          test_utils=("test_faketensor",) if interface_kind == "fp8" else
                          ("test_schema", "test_faketensor"))


def test_sparse_marshalling(provider):
    interface = RecordingInterface()
    provider(interface)
    H, Q, K = 2, 2, 8
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_ds_mla", topk=K)
    out, lse = BACKEND.decode(*x.args())
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H, x.sparse_indices))
    (name, args, kwargs), = interface.calls
    assert args[1].shape == (x.kv_cache.shape[0], 64, 1, 656) and args[1].dtype == torch.uint8
    indices = kwargs["indices"]  # [B, Q, K] padded with -1 to a multiple of 64
    assert indices.shape == (len(SEQ_LENS), Q, 64)
    assert torch.equal(indices[..., :K].reshape(-1, K), x.sparse_indices) and bool((indices[..., K:] == -1).all())
    assert kwargs["is_fp8_kvcache"] is True and kwargs["causal"] is False


def test_legacy_interface_metadata(provider):
    interface = RecordingInterface(sched_meta=False)
    provider(interface)
    x = make_decode_inputs([3, 9], num_heads=4, q_per_seq=2, fmt="fp8_ds_mla", topk=16)
    BACKEND.decode(*x.args())
    (n1, a1, k1), (n2, a2, k2) = interface.calls
    assert n1 == "get_mla_metadata" and a1[1:] == (8, 1) and k1 == dict(num_heads_q=4, is_fp8_kvcache=True, topk=64)
    assert n2 == "flash_mla_with_kvcache" and a2[5].shape == (4, 8) and a2[6].shape == (3,)
    interface.calls.clear()
    y = make_decode_inputs([3, 9], num_heads=4)
    BACKEND.decode(*y.args())
    assert interface.calls[0][1][1:] == (4, 1) and interface.calls[0][2]["topk"] is None


def test_fp8_marshalling_quantizes_the_query(provider):
    ops = RecordingFP8Ops()
    provider(None, ops)
    H, Q = 3, 2
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_e4m3", q_dtype=torch.float16)
    out, lse = BACKEND.decode(*x.args())
    assert out.dtype == torch.float16
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H))
    meta_call, fwd = ops.calls
    assert meta_call[2:] == (Q * H, 1) and torch.equal(meta_call[1], x.seq_lens.clamp_min(1))
    _, q8, kcache, dv, lens, table, scale, causal, md, splits, q_descale, k_descale = fwd
    assert lens is meta_call[1]  # the kernel sees the lengths its schedule was made from
    q = torch.cat([x.q_nope, x.q_pe], -1).float()
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (len(SEQ_LENS), Q, H, 576)
    torch.testing.assert_close(q_descale, (q.abs().amax() / 448).reshape(1))
    rel = (q8.float().reshape(q.shape) * q_descale - q).norm() / q.norm()
    assert rel < 0.05  # e4m3 keeps 3 mantissa bits
    assert k_descale is x.kv_scale and kcache.dtype == torch.float8_e4m3fn and causal is True
    assert md.shape == (4, 8) and scale == x.softmax_scale and dv == 512


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_out_only_op_returns_the_decode_output(provider, fmt):
    """``decode_out`` (the pass's op for calls without lse) gives ``decode``'s out, empty rows included,
    with the epilogue only where the kernel leaves empty rows unzeroed (the FP8 extension)."""
    provider(RecordingInterface(), RecordingFP8Ops())
    x = make_decode_inputs([0, 1, 65], num_heads=2, q_per_seq=2, fmt=fmt, topk=8 if fmt == "fp8_ds_mla" else None)
    out, _ = torch.ops.mla_flashmla.decode(*x.args(), [])
    only = torch.ops.mla_flashmla.decode_out(*x.args(), [])
    assert only.shape == out.shape and only.stride() == out.stride() and torch.equal(only, out)
    assert bool((only[:2] == 0).all())  # seq_len 0 with Q=2: both rows of the first sequence see nothing
    torch.library.opcheck(torch.ops.mla_flashmla.decode_out.default, (*x.args(), []),
                          test_utils=("test_faketensor",) if fmt != "bf16" else ("test_schema", "test_faketensor"))


def test_decode_op_opcheck(provider):
    provider(RecordingInterface())
    x = make_decode_inputs([1, 65], num_heads=2, q_per_seq=2)
    torch.library.opcheck(torch.ops.mla_flashmla.decode.default, (*x.args(), []),
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- sgl-flash-mla marshalling (CPU)

def _sgl_calls(sgl, name):
    return [c for c in sgl.calls if c[0] == name]


def _sgl_schedules(sgl):
    """Schedules the fake library made: by get_mla_decoding_metadata, or inside a kernel call given none."""
    return [c for c in sgl.calls if c[0] == "get_mla_decoding_metadata"
            or (c[0] == "flash_mla_with_kvcache" and not c[2]["scheduled"])]


@pytest.mark.parametrize("Q", [1, 2])
def test_sgl_dense_uses_legacy_kernels_and_hoisted_metadata(provider, Q):
    """The call that failed before ('pass use_legacy=True'): metadata from get_mla_decoding_metadata (no
    attention run to make it), assigned onto a fresh FlashMLASchedMeta, the kernel with use_legacy=True."""
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    H = 3
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q)
    plan = torch.ops.mla_flashmla.plan(*x.args())
    (_, margs, mkw), = _sgl_calls(sgl, "get_mla_decoding_metadata")
    assert margs[0] is x.seq_lens and margs[1:] == (Q * H, 1, H)
    assert mkw == dict(is_fp8_kvcache=False, topk=None, use_legacy=True)
    assert not _sgl_calls(sgl, "flash_mla_with_kvcache")  # planning ran no attention
    out, lse = torch.ops.mla_flashmla.decode(*x.args(), plan)
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H))
    (_, args, kwargs), = _sgl_calls(sgl, "flash_mla_with_kvcache")
    meta = args[5]
    assert meta.tile_scheduler_metadata is plan[0] and meta.num_splits is plan[1] and args[2] is plan[3]
    assert kwargs["causal"] == (Q > 1) and kwargs["indices"] is None and not kwargs["is_fp8_kvcache"]
    sgl.calls.clear()
    eager_out, eager_lse = BACKEND.decode(*x.args())  # eager: plans itself, same result
    assert torch.equal(eager_out, out) and torch.equal(eager_lse, lse)


def test_calls_without_a_plan_share_one_until_the_lengths_change(provider):
    """Eager calls over the same block_table / seq_lens make FlashMLA's
    schedule once and reuse it, with the same results; a write to seq_lens makes the next call plan again.
    mla.paged_decode's eager run (out only) gives the same output."""
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    fm.PLANS.forget()
    x = make_decode_inputs(SEQ_LENS, num_heads=3)
    out, lse = BACKEND.decode(*x.args())
    for _ in range(2):
        again = BACKEND.decode(*x.args())
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    args9 = (*x.args(), None)
    out_only = BACKEND.eager_decode(None, args9, with_lse=False)(*args9)
    assert torch.equal(out_only, out)
    metas = [c[1][5] for c in _sgl_calls(sgl, "flash_mla_with_kvcache")]
    assert len(_sgl_schedules(sgl)) == 1 and len(metas) == 4
    assert all(m.tile_scheduler_metadata is metas[0].tile_scheduler_metadata for m in metas)
    x.seq_lens.add_(0)  # a write through torch
    BACKEND.decode(*x.args())
    assert len(_sgl_schedules(sgl)) == 2


def test_compiled_ops_given_no_plan_keep_none(provider):
    """The ops a compiled graph calls with no plan (one-call graphs, per-layer graphs) plan inline and store
    nothing: under CUDA graph trees a stored plan would be pool memory no graph output accounts for
    ("tensors in the cudagraph pool not tracked as outputs")."""
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    fm.PLANS.forget()
    x = make_decode_inputs(SEQ_LENS, num_heads=3)
    hits = fm.PLANS.hits
    for op in (torch.ops.mla_flashmla.decode, torch.ops.mla_flashmla.decode, torch.ops.mla_flashmla.decode_out):
        op(*x.args(), [])
    assert len(_sgl_schedules(sgl)) == 3
    assert fm.PLANS.hits == hits and not fm.PLANS._entries


def test_dense_call_planning_for_itself_is_one_library_call(provider, monkeypatch):
    """A graph holding one dense decode call (mla_flashmla::decode_out given no plan): one library call, whose
    kernel makes its own schedule, and no row counts (nothing reads them: the kernel zeroes rows that see
    nothing). The same output as a call on a plan made first."""
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    x = make_decode_inputs(SEQ_LENS, num_heads=3)
    planned = torch.ops.mla_flashmla.decode_out(*x.args(), torch.ops.mla_flashmla.plan(*x.args()))
    sgl.calls.clear()
    with monkeypatch.context() as m:
        m.setattr(fm, "row_counts", lambda *a: pytest.fail("row counts made for a call that discards them"))
        out = torch.ops.mla_flashmla.decode_out(*x.args(), [])
    assert [c[0] for c in sgl.calls] == ["flash_mla_with_kvcache"] and not sgl.calls[0][2]["scheduled"]
    assert torch.equal(out, planned)


@pytest.mark.parametrize("static_scale", [False, True], ids=["measured-scale", "static-q_scale"])
def test_sgl_dense_fp8_quantizes_the_query_with_one_scale(provider, static_scale):
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    H, Q = 3, 2
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_e4m3", q_dtype=torch.float16)
    q = torch.cat([x.q_nope, x.q_pe], -1).float()
    q_scale = (q.abs().amax() / 300).reshape(1) if static_scale else None  # calibrated with headroom
    out, lse = BACKEND.decode_with_q_scale(*x.args(), q_scale)
    assert out.dtype == torch.float16
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H))
    (_, margs, mkw), = _sgl_calls(sgl, "get_mla_decoding_metadata")
    assert torch.equal(margs[0], x.seq_lens.clamp_min(1)) and mkw["is_fp8_kvcache"] and mkw["topk"] is None
    (_, args, kwargs), = _sgl_calls(sgl, "flash_mla_with_kvcache")
    q8, kcache, table, lens = args[:4]
    assert lens is margs[0]  # the kernel sees the lengths its schedule was made from
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (len(SEQ_LENS), Q, H, 576)
    assert kwargs["is_fp8_kvcache"] is True and kwargs["descale_k"] is x.kv_scale and kwargs["causal"] is True
    expected_q8, expected_descale = quantize_query_reference(q.view(len(SEQ_LENS), Q, H, 576), q_scale)
    torch.testing.assert_close(kwargs["descale_q"], expected_descale)
    assert torch.equal(q8.view(torch.uint8), expected_q8.view(torch.uint8))
    if static_scale:
        assert kwargs["descale_q"] is q_scale or torch.equal(kwargs["descale_q"], q_scale)


def test_quantized_query_op_takes_the_compilers_e4m3_query(provider):
    """mla_flashmla::decode_quantized_query, the op the pass calls after quantizing q in the graph: the
    e4m3 query and its descale reach the kernel untouched; out in the requested dtype."""
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    H, Q = 2, 2
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_e4m3")
    q8, descale = quantize_query_reference(torch.cat([x.q_nope, x.q_pe], -1))
    args = (q8, descale, x.kv_cache, x.block_table, x.seq_lens, x.softmax_scale, x.kv_scale, None, [], torch.bfloat16)
    out, lse = torch.ops.mla_flashmla.decode_quantized_query(*args)
    assert out.shape == (len(SEQ_LENS) * Q, H, 512) and out.dtype == torch.bfloat16
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H))
    kernel_q, kwargs = sgl.calls[-1][1][0], sgl.calls[-1][2]
    assert kernel_q.data_ptr() == q8.data_ptr() and kwargs["descale_q"] is descale
    torch.library.opcheck(torch.ops.mla_flashmla.decode_quantized_query.default, args,
                          test_utils=("test_faketensor",))
    with pytest.raises(TypeError, match=r"q must be \[T, H, 576\] float8_e4m3fn"):
        torch.ops.mla_flashmla.decode_quantized_query(torch.cat([x.q_nope, x.q_pe], -1), *args[1:])


def test_sgl_sparse_schedules_k_keys_per_sequence(provider):
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    H, Q, K = 64, 2, 8
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_ds_mla", topk=K)
    out, lse = BACKEND.decode(*x.args())
    (_, margs, mkw), = _sgl_calls(sgl, "get_mla_decoding_metadata")
    assert margs[0].tolist() == [64] * len(SEQ_LENS) and margs[1:] == (Q * H, 1, H)
    assert mkw == dict(is_fp8_kvcache=True, topk=64, use_legacy=True)
    (_, args, kwargs), = _sgl_calls(sgl, "flash_mla_with_kvcache")
    assert args[2] is None and args[3] is None and kwargs["causal"] is False and kwargs["is_fp8_kvcache"]
    assert torch.equal(kwargs["indices"][..., :K].reshape(-1, K), x.sparse_indices)
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H, x.sparse_indices))


@pytest.mark.parametrize("Q", [1, 2])
def test_dense_fp8_ds_mla_runs_the_sparse_kernel_on_every_visible_position(provider, Q):
    sgl = RecordingSglModule()
    provider(sgl, name=fm.SGL_MODULE)
    H = 64
    x = make_decode_inputs(SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_ds_mla")
    plan = torch.ops.mla_flashmla.plan(*x.args())
    indices = plan[3]
    assert torch.equal(indices, fm.dense_slot_indices(x.block_table, x.seq_lens, 64, len(SEQ_LENS) * Q))
    out, lse = torch.ops.mla_flashmla.decode(*x.args(), plan)
    _check_layout(out, lse, _expected_rows(SEQ_LENS, Q, H))  # rows with seq_len - Q + j < 0 are empty
    (_, args, kwargs), = _sgl_calls(sgl, "flash_mla_with_kvcache")
    assert kwargs["indices"].shape == (len(SEQ_LENS), Q, indices.shape[-1]) and kwargs["causal"] is False
    assert args[1].shape[-1] == 656 and args[2] is None


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("Q", [1, 2])
@pytest.mark.parametrize("page_size", [64, 16])
def test_dense_slot_indices_mean_the_dense_call(fmt, Q, page_size):
    """The reference on the built indices (a sparse call) is the reference of the dense call itself:
    same positions, causal rows included; -1 garbage in the block table never becomes a slot."""
    L, R = (512, 64) if fmt == "fp8_ds_mla" else (32, 16)
    x = make_decode_inputs([0, 1, page_size - 1, page_size, 2 * page_size + 3], num_heads=2, q_per_seq=Q, fmt=fmt,
                           kv_lora_rank=L, rope_dim=R, page_size=page_size, max_pages=4, seed=Q + page_size)
    T = x.q_nope.shape[0]
    indices = fm.dense_slot_indices(x.block_table, x.seq_lens, page_size, T)
    assert indices.dtype == torch.int32 and indices.shape[1] % 64 == 0 and indices.shape[1] >= 4 * page_size
    counts = (indices >= 0).sum(1)
    assert counts.tolist() == fm.visible_key_counts(x.seq_lens, T).tolist()
    assert bool((indices.ge(0).int().diff(dim=1) <= 0).all())  # a prefix of valid slots, then -1
    capacity = x.kv_cache.shape[0] * page_size
    assert bool(((indices == -1) | ((indices >= 0) & (indices < capacity))).all())
    dense = paged_decode_reference(*x.args())
    sparse = paged_decode_reference(*x.args()[:7], indices)
    # The reference folds dense and sparse keys in chunks of different widths: both sum in another order, so an
    # output rounded to bf16 may land one bf16 step (at most 2^-7 of its value) away (seen on one CPU, not another).
    assert sparse[0].dtype == dense[0].dtype == torch.bfloat16
    torch.testing.assert_close(sparse[0], dense[0], rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(sparse[1], dense[1], rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("lens_dtype", [torch.int32, torch.int64])
def test_the_slot_index_kernel_lists_what_the_torch_ops_list(Q, page_size, lens_dtype):
    """The one-launch kernel a GPU plan uses (kernels/slot_indices.py) against dense_slot_indices: random
    tables with garbage (-1, huge) past each length, lengths 0 to the capacity, a column-strided table; the
    output poisoned first, so an entry left unwritten fails."""
    from mla_inductor.kernels.slot_indices import dense_slot_indices_kernel
    from triton_support import TRITON_DEVICE

    g = torch.Generator().manual_seed(page_size * 10 + Q)
    max_pages, P = 5, 40
    lens = torch.tensor([0, 1, Q - 1, page_size, max_pages * page_size - 1, max_pages * page_size, 2 * page_size + 1],
                        dtype=lens_dtype).clamp_min(0)
    B = len(lens)
    table = torch.randint(0, P, (B, max_pages * 2), generator=g, dtype=torch.int32)[:, ::2]  # column-strided
    for b, n in enumerate(lens.tolist()):
        used = -(-n // page_size)
        table[b, used:] = torch.where(torch.rand(max_pages - used, generator=g) < 0.5, -1, 2 ** 30)
    want = fm.dense_slot_indices(table, lens, page_size, B * Q)
    width = fm.dense_index_width(max_pages, page_size)
    poisoned = torch.full((B * Q, width), 12345, dtype=torch.int32, device=TRITON_DEVICE)
    got = dense_slot_indices_kernel(table.to(TRITON_DEVICE), lens.to(TRITON_DEVICE), page_size, B * Q, width,
                                    out=poisoned)
    assert got is poisoned and got.dtype == torch.int32 and got.shape == want.shape == (B * Q, width)
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
SOURCES = ("sgl-flash-mla", "vllm")  # every GPU test runs on each provider that is importable


def _providers_of(source: str) -> fm.Providers:
    """The providers of one source alone: the sgl-flash-mla wheel's ``flash_mla``, or vLLM's build (its
    interface and its dense FP8 extension). Skips when that source is not importable here."""
    tried: list[str] = []
    if source == "sgl-flash-mla":
        found = [fm._interface_from_module(fm.SGL_MODULE, tried)]
        if found[0] is not None and not isinstance(found[0], fm.SglFlashMLA):
            pytest.skip(f"{fm.SGL_MODULE} is importable but is not the sgl-flash-mla wheel ({found[0]!r})")
    else:
        found = [fm._interface_from_module(fm.VLLM_INTERFACE, tried), fm.fp8_extension_provider(tried)]
    found = tuple(p for p in found if p is not None)
    if not found:
        pytest.skip(f"FlashMLA from {source} is not importable: {'; '.join(tried)}")
    return fm.Providers(found, "; ".join(tried))


@pytest.fixture(params=SOURCES)
def source(request, monkeypatch):
    """Route the backend to one provider source; yields its name."""
    providers = _providers_of(request.param)
    monkeypatch.setattr(fm, "find_providers", lambda: providers)
    yield request.param


MODE_FORMATS = {"dense": "bf16", "dense_fp8": "fp8_e4m3", "sparse": "fp8_ds_mla", "dense_ds": "fp8_ds_mla"}


def _skip_unless(mode: str, num_heads: int = 64):
    providers = fm.find_providers()
    if providers.for_mode(mode) is None:
        pytest.skip(f"no importable FlashMLA provider has {fm.MODE_NAMES[mode]} (found: {providers.summary()}; "
                    f"tried: {providers.tried})")
    problem = _problem(cache_format=MODE_FORMATS[mode], num_heads=num_heads, sparse=mode == "sparse",
                       topk=128 if mode == "sparse" else None, fp8_query=mode == "dense_fp8")
    reason = BACKEND.supports(problem, torch.cuda.get_device_capability())
    if reason is not None:
        pytest.skip(f"FlashMLA {mode} cannot run here: {reason}")


def _poison_allocator():
    """Fill freed blocks of the caching allocator with NaN so kernel outputs start as NaN."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def _poison_unread_slots(x, mode: str) -> int:
    """Fill every cache slot the call must not read with NaN bytes (0xFF is NaN in bf16, fp16, fp32 and
    e4m3fn, and in fp8_ds_mla's scales and rope): pages no sequence uses for the dense kernels (they read
    whole pages), every slot not listed (sparse) or not visible (dense_ds) for the sparse kernel. Call it
    after computing the reference, which gathers garbage slots and masks them. Returns how many slots."""
    P, page = x.kv_cache.shape[:2]
    keep = torch.zeros(P * page, dtype=torch.bool, device=x.kv_cache.device)
    T = x.q_nope.shape[0]
    if mode == "sparse":
        listed = x.sparse_indices[x.sparse_indices >= 0].long()
        keep[listed] = True
    elif mode == "dense_ds":
        indices = fm.dense_slot_indices(x.block_table, x.seq_lens, page, T)
        keep[indices[indices >= 0].long()] = True
    else:
        for b, n in enumerate(x.seq_lens.tolist()):
            for p in x.block_table[b, : -(-n // page)].tolist():
                keep[p * page: (p + 1) * page] = True
    flat = x.kv_cache.view(P * page, -1).view(torch.uint8)
    flat[~keep] = 0xFF
    return int((~keep).sum())


def _compare(x, out, lse, tol, lse_tol=1e-3, ref=None):
    ref_out, ref_lse = ref if ref is not None else paged_decode_reference(*x.args())
    e_out, e_lse = relative_error(out, ref_out), relative_error(lse, ref_lse)
    assert e_out <= tol and e_lse <= lse_tol, f"out error {e_out:.2e} (tol {tol}), lse error {e_lse:.2e}"
    return e_out, e_lse


def _run_poisoned(x, mode, run):
    """The reference first, then the unread slots and the allocator poisoned, then ``run()``."""
    ref = paged_decode_reference(*x.args())
    assert _poison_unread_slots(x, mode) > 0
    _poison_allocator()
    return ref, run()


GPU_SEQ_LENS = [0, 1, 63, 64, 65, 300]
FP8_QUERY_TOL, FP8_QUERY_LSE_TOL = 3e-2, 1e-2  # dense FP8 vs the bf16-query reference (see the fp8 test)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("Q", [1, 2])
def test_gpu_dense_matches_reference(source, dtype, H, Q):
    _skip_unless("dense")
    fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    x = make_decode_inputs(GPU_SEQ_LENS, num_heads=H, q_per_seq=Q, fmt=fmt, q_dtype=dtype, device="cuda",
                           seed=H + Q)
    ref, (out, lse) = _run_poisoned(x, "dense", lambda: BACKEND.decode(*x.args()))
    e = _compare(x, out, lse, TOLERANCE[dtype], ref=ref)
    _poison_allocator()
    plan = torch.ops.mla_flashmla.plan(*x.args())
    out2, lse2 = torch.ops.mla_flashmla.decode(*x.args(), plan)
    _compare(x, out2, lse2, TOLERANCE[dtype], ref=ref)
    print(f"{source} dense {fmt} H={H} Q={Q}: out error {e[0]:.2e}, lse error {e[1]:.2e}")


def _calibrated_q_scale(x, seed: int) -> torch.Tensor:
    """A static q_scale as a user would calibrate it: on other activations of the same distribution,
    with 25% headroom."""
    other = make_decode_inputs([8], num_heads=x.q_nope.shape[1], q_per_seq=16, device="cuda", seed=seed)
    return (torch.cat([other.q_nope, other.q_pe], -1).float().abs().amax() * 1.25 / 448).reshape(1)


@gpu
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("Q", [1, 2])
@pytest.mark.parametrize("scale", ["measured", "static"])
def test_gpu_dense_fp8_matches_reference(source, H, Q, scale):
    """The kernel takes q in e4m3 (per tensor: the measured amax / 448, or a calibrated static q_scale).
    Against the reference on the dequantized cache *and* dequantized query the error is the kernel's own
    (it also runs P.V in fp8: measured 5.7e-3 .. 8.5e-3 on H100 with the measured scale, under the bf16
    bound). Against the bf16 query it adds what e4m3 costs a query (tests/test_fp8_query.py), measured
    6.7e-3 .. 9.7e-3 in total (lse 1.1e-3 .. 1.6e-3) with the measured scale, bounded here by 3e-2 (1e-2)."""
    _skip_unless("dense_fp8")
    x = make_decode_inputs(GPU_SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_e4m3", device="cuda", seed=7 + H + Q)
    q_scale = _calibrated_q_scale(x, seed=H + Q) if scale == "static" else None
    q8, descale = quantize_query_reference(torch.cat([x.q_nope, x.q_pe], -1), q_scale)
    qd = (q8.float() * descale).to(torch.bfloat16)
    ref_qd = paged_decode_reference(qd[..., :512], qd[..., 512:], *x.args()[2:])  # before the poison
    ref, (out, lse) = _run_poisoned(x, "dense_fp8", lambda: BACKEND.decode_with_q_scale(*x.args(), q_scale))
    e_kernel = _compare(x, out, lse, TOLERANCE[torch.bfloat16], ref=ref_qd)
    e_total = _compare(x, out, lse, FP8_QUERY_TOL, lse_tol=FP8_QUERY_LSE_TOL, ref=ref)
    # the compiler's path: the e4m3 query made outside, handed to decode_quantized_query
    _poison_allocator()
    out2, lse2 = torch.ops.mla_flashmla.decode_quantized_query(q8, descale, *x.args()[2:], [], torch.bfloat16)
    _compare(x, out2, lse2, FP8_QUERY_TOL, lse_tol=FP8_QUERY_LSE_TOL, ref=ref)
    print(f"{source} dense fp8 ({scale} q scale) H={H} Q={Q}: vs dequantized-q reference out {e_kernel[0]:.2e} "
          f"lse {e_kernel[1]:.2e}; vs bf16-q reference out {e_total[0]:.2e} lse {e_total[1]:.2e}")


@gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("Q", [1, 2])
@pytest.mark.parametrize("topk", [64, 128, 100])
def test_gpu_sparse_matches_reference(source, H, Q, topk):
    _skip_unless("sparse")
    x = make_decode_inputs(GPU_SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_ds_mla", topk=topk, device="cuda",
                           seed=3 + H + Q + topk)
    assert bool((x.sparse_indices < 0).any())  # padding present (short rows) and an all-padding row (seq_len 0)
    ref, (out, lse) = _run_poisoned(x, "sparse", lambda: BACKEND.decode(*x.args()))
    e = _compare(x, out, lse, TOLERANCE[torch.bfloat16], ref=ref)
    plan = torch.ops.mla_flashmla.plan(*x.args())
    _compare(x, *torch.ops.mla_flashmla.decode(*x.args(), plan), TOLERANCE[torch.bfloat16], ref=ref)
    print(f"{source} sparse H={H} Q={Q} topk={topk}: out error {e[0]:.2e}, lse error {e[1]:.2e}")


@gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("Q", [1, 2])
@pytest.mark.parametrize("max_pages", [None, 9])
def test_gpu_dense_fp8_ds_mla_matches_reference(source, H, Q, max_pages):
    """A dense call on the 656-byte cache through the sparse kernel: every slot past each row's visible
    prefix is NaN, so a kernel that read a -1 index (or the tail of a page) would fail."""
    _skip_unless("dense_ds", num_heads=H)
    x = make_decode_inputs(GPU_SEQ_LENS, num_heads=H, q_per_seq=Q, fmt="fp8_ds_mla", device="cuda", seed=11 + H + Q,
                           max_pages=max_pages)
    ref, (out, lse) = _run_poisoned(x, "dense_ds", lambda: BACKEND.decode(*x.args()))
    e = _compare(x, out, lse, TOLERANCE[torch.bfloat16], ref=ref)
    _poison_allocator()
    plan = torch.ops.mla_flashmla.plan(*x.args())
    _compare(x, torch.ops.mla_flashmla.decode_out(*x.args(), plan), lse, TOLERANCE[torch.bfloat16], ref=ref)
    print(f"{source} dense fp8_ds_mla H={H} Q={Q} max_pages={max_pages}: out error {e[0]:.2e}, "
          f"lse error {e[1]:.2e}")


@gpu
def test_gpu_opcheck(source):
    _skip_unless("dense")
    x = make_decode_inputs([1, 65], num_heads=16, q_per_seq=2, device="cuda")
    plan = torch.ops.mla_flashmla.plan(*x.args())
    torch.library.opcheck(torch.ops.mla_flashmla.plan.default, x.args(), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mla_flashmla.decode.default, (*x.args(), plan))
    # Like the plan op: the schedule tensors hold unwritten padding, so two runs are not bit-equal.
    torch.library.opcheck(torch.ops.mla_flashmla.decode_and_plan.default, x.args(),
                          test_utils=("test_schema", "test_faketensor"))


def _two_layers(q1, p1, q2, p2, c1, c2, block_table, seq_lens, scale, kv_scale, q_scale=None):
    a = torch.ops.mla.paged_decode(q1, p1, c1, block_table, seq_lens, scale, kv_scale, None, q_scale)
    b, lse = torch.ops.mla.paged_decode_with_lse(q2, p2, c2, block_table, seq_lens, scale, kv_scale, None, q_scale)
    return a, b, lse


def _chained_layers(q1, p1, q2, p2, c1, c2, block_table, seq_lens, scale, kv_scale, q_scale=None):
    """Layer 2 reads layer 1's output, so layer 1 (with lse) comes first in any graph order and layer 2
    (no lse) is the one handed the plan."""
    b, lse = torch.ops.mla.paged_decode_with_lse(q1, p1, c1, block_table, seq_lens, scale, kv_scale, None, q_scale)
    a = torch.ops.mla.paged_decode(b, p2, c2, block_table, seq_lens, scale, kv_scale, None, q_scale)
    return b, a, lse


def _two_layer_inputs(seq_lens, H=16, Q=1, fmt="bf16"):
    x = make_decode_inputs(seq_lens, num_heads=H, q_per_seq=Q, fmt=fmt, device="cuda", seed=1)
    y = make_decode_inputs(seq_lens, num_heads=H, q_per_seq=Q, fmt=fmt, device="cuda", seed=2)
    # Same seq_lens, so y's cache has x's shape; any page holds random values, so x's table serves both.
    return [x.q_nope, x.q_pe, y.q_nope, y.q_pe, x.kv_cache, y.kv_cache, x.block_table, x.seq_lens,
            x.softmax_scale, x.kv_scale]


def _check_two_layers(args, result, tol, lse_tol=1e-3, chained=False):
    q1, p1, q2, p2, c1, c2, table, lens, scale, kv_scale = args[:10]
    r1 = paged_decode_reference(q1, p1, c1, table, lens, scale, kv_scale)
    r2 = paged_decode_reference(result[0] if chained else q2, p2, c2, table, lens, scale, kv_scale)
    assert relative_error(result[0], r1[0]) <= tol
    assert relative_error(result[1], r2[0]) <= tol
    assert relative_error(result[2], (r1 if chained else r2)[1]) <= lse_tol


def _expected_plan_ops(code: str, calls: int = 2) -> None:
    """One schedule per forward: a plan op where the provider makes it on the device, else the first
    layer's decode_and_plan; never both, never a second one."""
    if BACKEND.decode_and_plan_op() is None:
        assert code.count("mla_flashmla.plan.default(") == 1 and "decode_and_plan" not in code, code
    else:
        assert code.count("mla_flashmla.decode_and_plan.default(") == 1, code
        assert "mla_flashmla.plan.default(" not in code, code


@gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_gpu_compiled_calls_flashmla(source, fmt):
    mode = {"bf16": "dense", "fp8_ds_mla": "dense_ds"}[fmt]
    H = 16 if fmt == "bf16" else 64
    _skip_unless(mode, num_heads=H)
    import mla_inductor.lowering  # noqa: F401 - installs the pass
    from torch._inductor.utils import run_and_get_code

    args = _two_layer_inputs([0, 1, 63, 64, 65, 300], H=H, Q=2, fmt=fmt)
    torch._dynamo.reset()
    _poison_allocator()
    with mla_inductor.prefer_backends("flashmla"):
        result, (code, *_) = run_and_get_code(torch.compile(_two_layers, fullgraph=True), *args)
    _expected_plan_ops(code)
    runs = [op for op in ("decode_and_plan", "decode", "decode_out") if f"mla_flashmla.{op}.default(" in code]
    assert sum(code.count(f"mla_flashmla.{op}.default(") for op in runs) == 2, code
    _check_two_layers(args, result, TOLERANCE[torch.bfloat16])
    # A later call whose lse nobody reads gets the out-only op (no epilogue kernel).
    torch._dynamo.reset()
    _poison_allocator()
    with mla_inductor.prefer_backends("flashmla"):
        result, (code, *_) = run_and_get_code(torch.compile(_chained_layers, fullgraph=True), *args)
    _expected_plan_ops(code)
    # Layer 1 (its lse is read) runs decode where the provider makes the schedule in a plan op, and
    # decode_and_plan where only a kernel call makes it; layer 2 runs decode_out either way.
    first_decodes = 1 if BACKEND.decode_and_plan_op() is None else 0
    assert code.count("mla_flashmla.decode_out.default(") == 1, code
    assert code.count("mla_flashmla.decode.default(") == first_decodes, code
    _check_two_layers(args, result, TOLERANCE[torch.bfloat16], chained=True)


@gpu
@pytest.mark.parametrize("scale", ["static", "measured"])
def test_gpu_compiled_fp8_query_made_by_the_compiler(source, scale):
    """fp8_e4m3 cache, the call opted in: the generated code quantizes q in Inductor kernels (fused with
    the cat) and calls decode_quantized_query; results within the e4m3-query bound. Without opting in the
    same graph keeps q in bf16 (another backend, no e4m3 query)."""
    _skip_unless("dense_fp8")
    import mla_inductor.lowering  # noqa: F401
    from torch._inductor.utils import run_and_get_code

    args = _two_layer_inputs([0, 1, 63, 64, 65, 300], H=16, Q=2, fmt="fp8_e4m3")
    q_scale = _calibrated_q_scale(make_decode_inputs([1], num_heads=16, device="cuda"), seed=5)
    torch._dynamo.reset()
    _poison_allocator()
    with contextlib.ExitStack() as stack:
        if scale == "measured":
            stack.enter_context(mla_inductor.allow_fp8_query())
        result, (code, *_) = run_and_get_code(torch.compile(_two_layers, fullgraph=True), *args,
                                              q_scale if scale == "static" else None)
    assert code.count("mla_flashmla.decode_quantized_query.default(") == 2, code
    assert code.count("mla_flashmla.plan.default(") == 1 and "float8e4nv" in code, code  # cast in Inductor's kernel
    _check_two_layers(args, result, FP8_QUERY_TOL, lse_tol=FP8_QUERY_LSE_TOL)
    torch._dynamo.reset()
    result, (code, *_) = run_and_get_code(torch.compile(_two_layers, fullgraph=True), *args)
    assert "decode_quantized_query" not in code and "float8e4nv" not in code, code
    _check_two_layers(args, result, TOLERANCE[torch.bfloat16])


# lse's relative error in a step where every visible row sees ONE key (the replay step [0, 0, 0, 1]): its lse is that
# single logit (|lse| ~ 0.5; a long row's lse ~ max + log n ~ 5 dilutes the same absolute error tenfold), so its
# relative error is one dot product's, i.e. what quantization costs each element, not averaged away:
# - fp8_e4m3: q in e4m3 with one per-tensor scale: up to 2^-4 relative per element (3 mantissa bits), about
#   2^-4/sqrt(3) ~ 3.6e-2 for a dot product of random vectors; measured 3.0e-2 (H100, vLLM's build). Bound 2^-4.
# - fp8_ds_mla: the reference uses the latent dequantized in fp32 (e4m3 x per-128 fp32 scale, exact); the
#   sparse kernel computes QK in bf16 on the latent dequantized to bf16: up to 2^-9 per element for that
#   rounding (plus 2^-9 if the tile scale is rounded first); measured 2.3e-3. Bound 2^-8.
# - bf16: logits are exact products accumulated in fp32; 1e-3 (the non-graph tests' bound) holds.
# out is unaffected (a one-key row's out is that key's value) and keeps the modes' usual bounds; stale plans
# or mishandled empty rows would show in out and in the -inf rows, which relative_error requires exactly.
ONE_KEY_LSE_TOL = {"bf16": 1e-3, "fp8_e4m3": 2 ** -4, "fp8_ds_mla": 2 ** -8}


@gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_gpu_cuda_graph_replays_follow_seq_lens(source, fmt):
    mode = {"bf16": "dense", "fp8_e4m3": "dense_fp8", "fp8_ds_mla": "dense_ds"}[fmt]
    H = 16 if fmt != "fp8_ds_mla" else 64
    _skip_unless(mode, num_heads=H)
    import mla_inductor.lowering  # noqa: F401

    args = _two_layer_inputs([300, 130, 64, 65], H=H, Q=1, fmt=fmt)
    q_scale = _calibrated_q_scale(make_decode_inputs([1], num_heads=H, device="cuda"), seed=3)
    tol, lse_tol = (FP8_QUERY_TOL, FP8_QUERY_LSE_TOL) if fmt == "fp8_e4m3" else (TOLERANCE[torch.bfloat16], 1e-3)
    lens = args[7]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with mla_inductor.prefer_backends("flashmla"):
        step = torch.compile(_chained_layers, mode="reduce-overhead", fullgraph=True)
        for new_lens in ([300, 130, 64, 65], [1, 0, 63, 2], [257, 129, 30, 64], [0, 0, 0, 1], [300, 130, 64, 65]):
            lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
            result = step(*args, q_scale if fmt == "fp8_e4m3" else None)
            one_key = max(new_lens) == 1  # lse is single logits there: see ONE_KEY_LSE_TOL
            _check_two_layers(args, [r.clone() for r in result], tol,
                              lse_tol=ONE_KEY_LSE_TOL[fmt] if one_key else lse_tol, chained=True)
    counters = torch._dynamo.utils.counters["inductor"]
    assert counters["cudagraph_skips"] == 0, dict(counters)


# ----------------------------------------------------------------------------- FP8 query quantization kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=[pytest.mark.gpu] if DEV == "cuda" else [])
                                   for d in (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("shape,chunk", [((3, 2, 5, 576), None), ((17, 1, 128, 576), None), ((17, 1, 128, 576), 16)],
                         ids=["small", "large", "large-chunked"])
def test_fp8_query_kernel_matches_the_torch_quantization(dtype, shape, chunk, monkeypatch):
    """The Triton quantization (CUDA; interpreter without a GPU) vs quantize_query's torch path, in both
    launch configurations (17280 and 1.25M values: several blocks and a partial one each); "chunked"
    makes the cast reduce the 153 partial maxima 16 at a time, with the amax in the last block."""
    from mla_inductor.kernels import fp8_query as fp8_query_kernel
    from mla_inductor.kernels.fp8_query import SMALL, quantize_per_tensor_e4m3

    if chunk:
        monkeypatch.setattr(fp8_query_kernel, "PARTIALS_CHUNK", chunk)
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(*shape, generator=g) * 3).to(dtype)
    assert (q.numel() <= SMALL) == (shape[0] == 3)
    q[-1 if chunk else 1, 0, -1 if chunk else 2, 7] = -40.0  # the amax, negative
    q8, descale = quantize_per_tensor_e4m3(q.to(DEV))
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and descale.shape == (1,)
    assert float(descale) == pytest.approx(40.0 / 448, rel=1e-6)
    assert float(q8.float().abs().max()) == 448.0  # the amax maps onto the top of the range
    deq = q8.cpu().float() * descale.cpu()
    rel = ((deq - q.float()).norm() / q.float().norm()).item()
    # e4m3 keeps 3 mantissa bits: ~3% with round-to-nearest (GPU); the CPU interpreter truncates (~2x).
    torch_rel = ((quantize_query_fp8(q)[0].float() * (40.0 / 448) - q.float()).norm() / q.float().norm()).item()
    assert rel <= (1.1 if DEV == "cuda" else 3.0) * torch_rel and rel < (0.04 if DEV == "cuda" else 0.09)
