"""The FlashInfer backends (fa2, fa3, trtllm-gen, XQA).

CPU part (runs in CI): the supports() matrix per capability, and the marshalling of every backend against
a fake ``flashinfer`` module whose functions compute attention the way FlashInfer documents its arguments
(CSR page lists, right-aligned causal mask, fused bmm scales, lse base) — so a wrong argument gives a wrong
result against ``paged_decode_reference``; plus opcheck of the plan/run ops.
GPU part (``-m gpu``): the real kernels against the reference, eager and compiled.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import mla_inductor
from mla_inductor.backends import _flashinfer_common as common
from mla_inductor.backends._common import finish_empty_rows as common_finish
from mla_inductor.backends import get_backend
from mla_inductor.contract import DecodeProblem
from mla_inductor.testing import TOLERANCE, make_decode_inputs, relative_error
from triton_support import needs_triton

NAMES = ("flashinfer_fa2", "flashinfer_fa3", "flashinfer_trtllm", "flashinfer_xqa")
CAPS = {"CPU": None, "SM80": (8, 0), "SM89": (8, 9), "SM90": (9, 0), "SM100": (10, 0), "SM120": (12, 0)}


def problem(**kw):
    base = dict(device_type="cuda", cache_format="bf16", q_dtype=torch.bfloat16, num_heads=128, kv_lora_rank=512,
                rope_dim=64, page_size=64, sparse=False, topk=None, q_per_seq=1)
    base.update(kw)
    return DecodeProblem(**base)


# ----------------------------------------------------------------------------- supports() matrix

ACCEPTS = {  # backend -> capabilities accepting the plain bf16, H=128, page 64, Q=1 problem
    "flashinfer_fa2": {"SM80", "SM89", "SM90", "SM100", "SM120"},
    "flashinfer_fa3": {"SM90"},
    "flashinfer_trtllm": {"SM100"},
    "flashinfer_xqa": {"SM120"},
}


@pytest.fixture
def cuda_13(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cap", sorted(CAPS))
def test_supports_matrix(name, cap, cuda_13):
    p = problem(device_type="cpu") if cap == "CPU" else problem()
    why = get_backend(name).supports(p, CAPS[cap])
    assert (why is None) == (cap in ACCEPTS[name]), why
    assert why is None or isinstance(why, str) and why


REFUSALS = [  # (backend, capability, problem overrides, words the reason must contain)
    ("flashinfer_fa2", "SM89", dict(cache_format="fp8_e4m3"), "SM90"),
    ("flashinfer_fa2", "SM90", dict(cache_format="fp8_e4m3", q_dtype=torch.float16), "bf16 q"),
    ("flashinfer_fa3", "SM90", dict(cache_format="fp8_e4m3", sparse=True, topk=64), "sparse"),
    ("flashinfer_fa3", "SM90", dict(cache_format="fp8_ds_mla"), "fp8_ds_mla"),
    ("flashinfer_fa3", "SM90", dict(cache_format="fp32", q_dtype=torch.float32), "fp32"),
    ("flashinfer_fa3", "SM90", dict(cache_format="fp16"), "same dtype"),
    ("flashinfer_fa3", "SM90", dict(kv_lora_rank=256), "kv_lora_rank"),
    ("flashinfer_fa3", "SM90", dict(num_heads=None), "num_heads"),
    ("flashinfer_fa3", "SM90", dict(num_heads=256), "num_heads"),
    ("flashinfer_fa3", "SM100", dict(), "SM90"),
    ("flashinfer_trtllm", "SM100", dict(num_heads=96), "64 < H < 128"),
    ("flashinfer_trtllm", "SM100", dict(page_size=16), "page_size"),
    ("flashinfer_trtllm", "SM100", dict(cache_format="fp16", q_dtype=torch.float16), "bf16 q"),
    ("flashinfer_trtllm", "SM100", dict(kv_lora_rank=256, sparse=True, topk=64), "512/64"),
    ("flashinfer_trtllm", "SM120", dict(), "SM100"),
    ("flashinfer_xqa", "SM120", dict(q_per_seq=2), "Q=1"),
    ("flashinfer_xqa", "SM120", dict(num_heads=16), "num_heads=128"),
    ("flashinfer_xqa", "SM120", dict(sparse=True, topk=64), "sparse"),
    ("flashinfer_xqa", "SM120", dict(page_size=8), "page_size"),
    ("flashinfer_fa2", "SM90", dict(q_per_seq=4, num_heads=63, cache_format="fp16", q_dtype=torch.float16), "multiple of 16"),
    ("flashinfer_fa3", "SM90", dict(q_per_seq=4, num_heads=63), "multiple of 16"),
]


@pytest.mark.parametrize("name,cap,overrides,words", REFUSALS)
def test_supports_refusals(name, cap, overrides, words, cuda_13):
    why = get_backend(name).supports(problem(**overrides), CAPS[cap])
    assert why is not None and words in why, why


@pytest.mark.parametrize("overrides", [dict(), dict(cache_format="fp8_e4m3"), dict(sparse=True, topk=2048),
                                       dict(q_per_seq=2, num_heads=16), dict(page_size=32, num_heads=64)])
def test_trtllm_accepts(overrides):
    assert get_backend("flashinfer_trtllm").supports(problem(**overrides), (10, 0)) is None
    assert get_backend("flashinfer_trtllm").supports(problem(**overrides), (10, 3)) is None


def test_xqa_needs_new_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    assert "12.8" in get_backend("flashinfer_xqa").supports(problem(), (12, 0))


def test_selection_fails_over(cuda_13):
    """A refusal is a reason for select_backend, which then takes the next backend."""
    from mla_inductor.selection import select_backend

    avail = {n: None for n in NAMES} | {"reference": None}
    chosen = select_backend(problem(num_heads=96), (10, 0), available=avail,
                            preference=("flashinfer_trtllm", "flashinfer_fa2"))
    assert chosen.backend == "flashinfer_fa2" and "64 < H < 128" in chosen.reasons[0]


# ----------------------------------------------------------------------------- a fake flashinfer

def _attend(q, keys, scale, out_scale=1.0):
    """q [H, D] fp32, keys [S, D] fp32 -> (out [H, L], lse [H]) with L = 512-wide latent prefix."""
    logits = (q @ keys.T) * scale
    lse = torch.logsumexp(logits, -1)
    return (torch.softmax(logits, -1) @ keys[:, :LATENT]) * out_scale, lse


LATENT = 512


def _scale(x):
    return float(x.reshape(())) if isinstance(x, torch.Tensor) else float(x)


class FakeModule:
    """The compiled module a FlashInfer wrapper's plan() loads: ``run`` takes FlashInfer 0.6.18's positional
    arguments (workspaces, plan info, q, caches, page indices, out, lse, mask mode, heads, page size, sm_scale,
    lse base, fp8 scales) and computes attention as documented. It refuses a plan info other than its
    wrapper's current one (a call repeated from a stale plan)."""

    def __init__(self, wrapper):
        self.wrapper = wrapper

    def run(self, float_workspace, int_workspace, plan_info, q_nope, q_pe, ckv_cache, kpe_cache, kv_indices, out, lse,
            mask_mode, num_heads, page_size, sm_scale, return_lse_base_on_e, ckv_scale, kpe_scale, ckv_scale_arr):
        w = self.wrapper
        assert plan_info is w._plan_info and kv_indices is w.bufs["idx"], "a stale or foreign plan"
        assert num_heads == q_nope.shape[1] and ckv_scale_arr is None and ckv_scale == kpe_scale
        assert ckv_cache.data_ptr() + LATENT * ckv_cache.element_size() == kpe_cache.data_ptr(), "not views"
        assert ckv_cache.shape[1] == page_size
        qo, kv, idx, lens = (w.bufs[k].long() for k in ("qo", "kv", "idx", "lens"))
        q = torch.cat([q_nope, q_pe], -1).float()
        for i in range(len(lens)):
            n = int(lens[i])
            pages = idx[int(kv[i]): int(kv[i]) + -(-n // page_size)]
            assert (pages >= 0).all() and (pages < ckv_cache.shape[0]).all(), "reads outside the cache"
            keys = torch.cat([ckv_cache[pages], kpe_cache[pages]], -1).reshape(-1, q.shape[-1])[:n].float()
            keys = keys * ckv_scale
            rows = range(int(qo[i]), int(qo[i + 1]))
            for j, t in enumerate(rows):
                visible = n - len(rows) + j + 1 if mask_mode == 1 else n
                o, s = _attend(q[t], keys[:max(visible, 0)], sm_scale)
                out[t] = o.to(out.dtype)
                if lse is not None:  # optional, as FlashInfer's maybe_lse
                    lse[t] = s if return_lse_base_on_e else s / math.log(2)


class FakeWrapper:
    """BatchMLAPagedAttentionWrapper as documented: CSR pages, right-aligned causal mask, lse base 2 or e; like
    FlashInfer's, plan() loads a module and keeps a plan info, and run() checks its arguments against the plan
    and calls the module's run."""

    instances = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        assert use_cuda_graph and kv_indices is not None
        self.bufs = dict(qo=qo_indptr, kv=kv_indptr, idx=kv_indices, lens=kv_len_arr)
        self.backend = backend
        self.plans = []
        self.runs = 0  # calls of run() itself (the Python a caller may skip)
        self._float_workspace = float_workspace_buffer
        FakeWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type):
        assert all(t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr))
        assert kv_indices.numel() <= self.bufs["idx"].numel()
        self.bufs["qo"].copy_(qo_indptr)
        self.bufs["kv"].copy_(kv_indptr)
        self.bufs["idx"][: kv_indices.numel()].copy_(kv_indices)
        self.bufs["lens"].copy_(kv_len_arr)
        self.cfg = dict(num_heads=num_heads, page_size=page_size, causal=causal, sm_scale=sm_scale,
                        dims=(head_dim_ckv, head_dim_kpe), dtypes=(q_data_type, kv_data_type))
        self.plans.append(self.cfg)
        module_key = self.cfg["dims"] + self.cfg["dtypes"]  # FlashInfer's module: one per configuration, cached
        if getattr(self, "_module_key", None) != module_key:
            self._cached_module, self._module_key = FakeModule(self), module_key
        self._plan_info = [len(self.plans)]  # a new object per plan, as FlashInfer's

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            return_lse_base_on_e=False, *, ckv_scale=None, kpe_scale=None):
        self.runs += 1
        c = self.cfg
        assert (q_nope.dtype, ckv_cache.dtype) == c["dtypes"] and ckv_cache.shape[1] == c["page_size"]
        assert (ckv_scale is None) == (ckv_cache.dtype != torch.float8_e4m3fn)
        assert out is not None and out.shape == q_nope.shape and (lse is not None) == return_lse
        assert lse is None or lse.shape == q_nope.shape[:2]
        scale = 1.0 if ckv_scale is None else float(ckv_scale)
        self._cached_module.run(self._float_workspace, None, self._plan_info, q_nope, q_pe, ckv_cache, kpe_cache,
                                self.bufs["idx"], out, lse, 1 if c["causal"] else 0, q_nope.shape[1],
                                c["page_size"], c["sm_scale"], return_lse_base_on_e, scale, scale, None)
        return (out, lse) if return_lse else out


def _fake_trtllm(*, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                 block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0, bmm2_scale=1.0,
                 backend="auto", lse=None, return_lse=False):
    """trtllm-gen as documented: bmm1 = full QK scale, bmm2 = output scale; q_len right-aligned causal."""
    assert backend == "trtllm-gen" and return_lse and workspace_buffer.dtype == torch.uint8
    assert query.dim() == 4 and query.dtype == kv_cache.dtype and out.dtype == torch.bfloat16
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and int(seq_lens.min()) >= 1
    B, Q, H, D = query.shape
    page = kv_cache.shape[1]
    flat = kv_cache.reshape(-1, D).float()
    for b in range(B):
        n = int(seq_lens[b])
        assert n <= max_seq_len
        if sparse_mla_top_k:
            assert Q == 1 and block_tables.shape == (B, 1, sparse_mla_top_k)
            slots = block_tables[b, 0, :n].long()
        else:
            pos = torch.arange(n)
            slots = block_tables[b, pos // page].long() * page + pos % page
        assert (slots >= 0).all() and (slots < flat.shape[0]).all(), "reads outside the cache"
        keys = flat[slots]
        for j in range(Q):
            o, s = _attend(query[b, j].float(), keys[:n - Q + j + 1], _scale(bmm1_scale), _scale(bmm2_scale))
            out[b, j], lse[b * Q + j] = o.to(out.dtype), s
    return out, lse


def _fake_xqa(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
              seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, enable_pdl=None):
    """XQA as its kernel computes: QK scale = q_scale * kv_scale, V scale = kv_scale; writes no lse."""
    assert query.shape[1] == 1 and query.shape[2] == 128 and query.dtype == kv_cache.dtype
    assert out.shape == (query.shape[0], 128, kv_lora_rank) and max_seq_len == block_tables.shape[1] * kv_cache.shape[1]
    page = kv_cache.shape[1]
    flat = kv_cache.reshape(-1, query.shape[-1]).float()
    for b in range(query.shape[0]):
        pos = torch.arange(int(seq_lens[b]))
        keys = flat[block_tables[b, pos // page].long() * page + pos % page]
        o, _ = _attend(query[b, 0].float(), keys, _scale(bmm1_scale) * _scale(bmm2_scale), _scale(bmm2_scale))
        out[b] = o.to(out.dtype)
    return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """Install the fake as ``flashinfer`` and pretend a CUDA device exists (for unavailable_reason)."""
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.6.18.post1"
    fi.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeWrapper,
                                   trtllm_batch_decode_with_kv_cache_mla=_fake_trtllm,
                                   xqa_batch_decode_with_kv_cache_mla=_fake_xqa)
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setattr(common, "WORKSPACE_BYTES", 1 << 16)
    monkeypatch.setattr(common, "_WORKSPACES", {})
    monkeypatch.setattr(common, "_WRAPPERS", {})
    monkeypatch.setattr(common, "PLANS", common.PlanCache("flashinfer_wrapper"))
    FakeWrapper.instances = []
    common.flashinfer_unavailable_reason.cache_clear()
    yield fi
    common.flashinfer_unavailable_reason.cache_clear()


def test_unavailable_reason(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert all(get_backend(n).unavailable_reason() is None for n in NAMES)
    common.flashinfer_unavailable_reason.cache_clear()
    fake_flashinfer.__version__ = "0.6.3"
    assert "0.6.14" in get_backend("flashinfer_fa3").unavailable_reason()
    common.flashinfer_unavailable_reason.cache_clear()
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises
    assert "not importable" in get_backend("flashinfer_fa2").unavailable_reason()


def test_no_cuda_reason(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA" in get_backend("flashinfer_trtllm").unavailable_reason()


CPU_CASES = {  # small versions of the GPU cases: seq_lens with 0, 1 and page boundaries (page 64)
    "q1": dict(seq_lens=[0, 1, 64, 65, 130]),
    "q2": dict(seq_lens=[0, 1, 2, 64, 129], q_per_seq=2),
    "fp8": dict(seq_lens=[1, 64, 130], fmt="fp8_e4m3"),
    "fp8_q2": dict(seq_lens=[1, 65, 128], fmt="fp8_e4m3", q_per_seq=2),
    "sparse": dict(seq_lens=[0, 3, 70, 150], topk=16),
}


def _cpu_inputs(case, num_heads=4, page_size=64, **extra):
    kw = dict(CPU_CASES[case], num_heads=num_heads, page_size=page_size, seed=3, **extra)
    return make_decode_inputs(**kw)


def _check(backend, x, tol_out=None):
    ref_out, ref_lse = mla_inductor.paged_decode_reference(*x.args())
    out, lse = get_backend(backend).decode(*x.args())
    fp8 = x.kv_cache.dtype == torch.float8_e4m3fn
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert relative_error(out, ref_out) < (tol_out or TOLERANCE[x.q_nope.dtype]), relative_error(out, ref_out)
    assert relative_error(lse, ref_lse) < (2e-2 if fp8 else 1e-3), relative_error(lse, ref_lse)


@pytest.mark.parametrize("case", sorted(CPU_CASES))
@pytest.mark.parametrize("name", ["flashinfer_fa2", "flashinfer_fa3"])
def test_wrapper_marshalling(fake_flashinfer, name, case):
    x = _cpu_inputs(case)
    _check(name, x)
    (w,) = FakeWrapper.instances
    assert w.backend == name.split("_")[1]
    cfg = w.plans[-1]
    assert cfg["page_size"] == (1 if x.sparse_indices is not None else 64)
    assert cfg["causal"] == (CPU_CASES[case].get("q_per_seq", 1) > 1)
    assert cfg["dtypes"] == (torch.bfloat16, x.kv_cache.dtype)


def test_wrapper_reused_across_calls(fake_flashinfer):
    for seed in (0, 1):
        x = make_decode_inputs([5, 70], num_heads=4, seed=seed)
        _check("flashinfer_fa3", x)
    assert len(FakeWrapper.instances) == 1 and len(FakeWrapper.instances[0].plans) == 2


def test_one_plan_until_the_lengths_or_pages_change(fake_flashinfer):
    """Calls over the same block_table / seq_lens reuse the wrapper's plan (the layers of one eager step, or
    of a step compiled per layer); a write to either tensor makes the next call plan again."""
    x = make_decode_inputs([5, 70], num_heads=4, seed=0)
    for _ in range(3):
        _check("flashinfer_fa3", x)
    (w,) = FakeWrapper.instances
    assert len(w.plans) == 1 and common.PLANS.hits == 2
    x.seq_lens.copy_(torch.tensor([6, 71], dtype=torch.int32))
    _check("flashinfer_fa3", x)
    x.block_table[0, 1] = x.block_table[1, 0]  # any write counts, even of a page the lengths do not reach
    _check("flashinfer_fa3", x)
    assert len(w.plans) == 3


def test_wrapper_run_python_runs_once_per_wrapper_and_module(fake_flashinfer, monkeypatch):
    """wrapper.run() (its checks against the plan) runs for the first call; the later calls repeat its module
    call with their own q, cache and outputs, and match the reference. A new plan's info takes the old one's
    place in the repeated call (the module refuses a call repeated with the previous plan's info, and the
    results follow the new lengths); a plan that loads another module is checked through run() again."""
    x = make_decode_inputs([5, 70, 130], num_heads=4, seed=0)
    for seed in range(3):  # each call its own query and cache, one plan
        y = make_decode_inputs([5, 70, 130], num_heads=4, seed=seed + 10)
        x.q_nope, x.q_pe, x.kv_cache = y.q_nope, y.q_pe, y.kv_cache
        _check("flashinfer_fa3", x)
    (w,) = FakeWrapper.instances
    assert len(w.plans) == 1 and w.runs == 1
    x.seq_lens.copy_(torch.tensor([6, 71, 1], dtype=torch.int32))
    for _ in range(2):
        _check("flashinfer_fa3", x)
    assert len(w.plans) == 2 and w.runs == 1
    monkeypatch.setattr(w, "_module_key", None)  # the next plan loads another module
    x.seq_lens.copy_(torch.tensor([7, 1, 0], dtype=torch.int32))
    for _ in range(2):
        _check("flashinfer_fa3", x)
    assert len(w.plans) == 3 and w.runs == 2


def test_wrapper_run_that_cannot_be_repeated_runs_every_time(fake_flashinfer, monkeypatch):
    """A FlashInfer whose run() hands the module something other than the caller's q (here a copy): the call
    cannot be repeated with another q put in place, so every call goes through run()."""
    original = FakeWrapper.run
    monkeypatch.setattr(FakeWrapper, "run", lambda self, q_nope, *args, **kw: original(self, q_nope.clone(), *args, **kw))
    x = make_decode_inputs([5, 70], num_heads=4, seed=0)
    for _ in range(3):
        _check("flashinfer_fa3", x)
    (w,) = FakeWrapper.instances
    assert len(w.plans) == 1 and w.runs == 3


def test_plan_reads_the_registered_host_lengths(fake_flashinfer):
    """A registered host copy is what the plan reads (here deliberately different from the device tensor,
    to see which one was read); without one, or once seq_lens is written, the device's lengths."""
    x = make_decode_inputs([5, 70], num_heads=4, seed=0)
    mla_inductor.register_host_lengths(x.seq_lens, torch.tensor([64, 70], dtype=torch.int32))
    get_backend("flashinfer_fa3").decode(*x.args())
    (w,) = FakeWrapper.instances
    assert w.bufs["lens"].tolist() == [64, 70]
    x.seq_lens.add_(0)  # a write through torch: the host copy is stale
    get_backend("flashinfer_fa3").decode(*x.args())
    assert w.bufs["lens"].tolist() == [5, 70]


@pytest.mark.parametrize("case,finished", [("q1", True), ("q2", True), ("fp8", False), ("fp8_q2", True),
                                           ("sparse", True)])
def test_empty_rows_are_finished_only_where_the_plan_has_some(fake_flashinfer, monkeypatch, case, finished):
    """fp8_q2 has a length-1 sequence with Q=2: its first row sees nothing."""
    calls = []
    monkeypatch.setattr(common, "finish_empty_rows", lambda *args: calls.append(1) or common_finish(*args))
    _check("flashinfer_fa3", _cpu_inputs(case))
    assert bool(calls) == finished


def test_a_plan_is_refused_while_a_cuda_graph_is_captured(fake_flashinfer, monkeypatch):
    """A plan made or looked up during a capture would be replayed with the capture's lengths: refused, with what
    to do instead, before anything is planned (CUDA tensors stood in for by their ``is_cuda``)."""
    x = make_decode_inputs([5, 70], num_heads=4)
    key = common._wrapper_key("fa3", x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.softmax_scale, None)
    on_cuda = types.SimpleNamespace(is_cuda=True)
    from mla_inductor import contract

    monkeypatch.setattr(contract, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"flashinfer_fa3 backend plans on the host.*reduce-overhead.*"
                                           r"prefer_backends\("):
        common.planned_counts(key, on_cuda, x.kv_cache, x.block_table, x.seq_lens, None)
    assert not FakeWrapper.instances  # nothing planned
    common.planned_counts(key, x.q_nope, x.kv_cache, x.block_table, x.seq_lens, None)  # CPU tensors: never captured
    monkeypatch.setattr(contract, "_capturing", lambda: False)
    common.planned_counts(key, on_cuda, x.kv_cache, x.block_table, x.seq_lens, None)  # a stored plan, no capture



def test_an_eager_call_signature_made_while_captured_refuses_to_plan(fake_flashinfer):
    """The eager run is bound to the capture state of its signature (ops keys on it, so the run asks the driver
    nothing): bound while captured, every call is refused before anything is planned; bound outside a capture,
    it plans and runs."""
    x = make_decode_inputs([5, 70], num_heads=4)
    args = (*x.args(), None)
    backend = get_backend("flashinfer_fa3")
    captured_run = backend.eager_decode(None, args, with_lse=False, captured=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="flashinfer_fa3 backend plans on the host"):
            captured_run(*args)
    assert not FakeWrapper.instances  # nothing planned
    out = backend.eager_decode(None, args, with_lse=False)(*args)
    want = mla_inductor.paged_decode_reference(*x.args())[0]
    assert relative_error(out, want) < TOLERANCE[x.q_nope.dtype]
    assert len(FakeWrapper.instances) == 1

@pytest.mark.parametrize("case,lse_handed", [("fp8", False), ("sparse", True), ("q1", True)])
def test_out_only_op_hands_the_kernel_no_lse_unless_rows_are_finished(fake_flashinfer, monkeypatch, case,
                                                                     lse_handed):
    """run_fa3_out (a compiled mla.paged_decode) gives the reference's out; the kernel gets no lse to write
    (FlashInfer's is optional) unless the plan has rows that see nothing, whose finishing reads it (q1: a
    length-0 sequence; sparse: an all-padding row). Both the recorded first run and the repeated one."""
    x = _cpu_inputs(case)
    backend = get_backend("flashinfer_fa3")
    handed = []
    original = FakeModule.run
    monkeypatch.setattr(FakeModule, "run", lambda self, *a: handed.append(a[9]) or original(self, *a))
    plan = backend.plan_op()(*x.args())
    ref_out, _ = mla_inductor.paged_decode_reference(*x.args())
    for _ in range(2):
        out = backend.out_only_op()(*x.args(), plan)
        assert relative_error(out, ref_out) < TOLERANCE[x.q_nope.dtype], relative_error(out, ref_out)
    assert len(handed) == 2 and (handed[-1] is not None) == lse_handed
    (w,) = FakeWrapper.instances
    assert w.runs == 1  # the second call repeated the module call
    if case == "q1":  # (the stand-in module cannot compute on an fp8 cache under opcheck's schema mode)
        torch.library.opcheck(backend.out_only_op(), (*x.args(), plan),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def two_layer_step(scale: float):
    """A compiled step's two calls over one cache: ``mla.paged_decode`` (the out-only run op) and
    ``mla.paged_decode_with_lse`` on another query (the run op with lse)."""

    def two_layers(q_nope, q_pe, cache, block_table, seq_lens, kv_scale):
        a = torch.ops.mla.paged_decode(q_nope, q_pe, cache, block_table, seq_lens, scale, kv_scale)
        b, lse = torch.ops.mla.paged_decode_with_lse(q_nope * 0.5, q_pe, cache, block_table, seq_lens, scale,
                                                     kv_scale)
        return a, b, lse

    return two_layers


@pytest.mark.slow
def test_compiled_runs_call_their_sites_and_read_each_steps_plan(fake_flashinfer, monkeypatch):
    """Compiled (on CPU, the fake library): each run op is called by its site's own callable (``_RunSite``: static
    sizes, the wrapper's key computed once per site), which runs the wrapper the graph's plan op planned; after
    the lengths change, the next step plans again and both layers read the new plan."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    import mla_inductor.lowering  # noqa: F401 - installs the pass

    backend = get_backend("flashinfer_fa3")
    monkeypatch.setattr(backend, "supports", lambda problem, capability: None)
    monkeypatch.setattr(backend, "unavailable_reason", lambda: None)
    x = make_decode_inputs([5, 70, 1], num_heads=4, seed=8)
    two_layers = two_layer_step(x.softmax_scale)

    def reference():
        a, _ = mla_inductor.paged_decode_reference(*x.args())
        return (a, *mla_inductor.paged_decode_reference(x.q_nope * 0.5, *x.args()[1:]))

    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)
    torch._dynamo.reset()
    with mla_inductor.prefer_backends("flashinfer_fa3"), fresh_cache():
        step = torch.compile(two_layers, fullgraph=True)
        got, codes = run_and_get_code(step, *args)
        results = [(got, reference())]
        x.seq_lens.copy_(torch.tensor([64, 3, 20], dtype=torch.int32))  # a write: the next step plans again
        results.append((step(*args), reference()))
    for op in ("run_fa3_out", "run_fa3"):
        assert f"= extern_kernels.mla_direct.mla_flashinfer.{op}.site_default_" in codes[0], (op, codes[0][-3000:])
    (w,) = FakeWrapper.instances
    assert len(w.plans) == 2
    for (a, b, lse), (ref_a, ref_b, ref_lse) in results:
        assert relative_error(a, ref_a) < TOLERANCE[torch.bfloat16]
        assert relative_error(b, ref_b) < TOLERANCE[torch.bfloat16] and relative_error(lse, ref_lse) < 1e-3


def test_run_without_plan_is_an_error(fake_flashinfer):
    x = make_decode_inputs([5, 70], num_heads=4)
    with pytest.raises(RuntimeError, match="plan op must run first"):
        common.wrapper_run("fa3", *x.args(), [torch.ones(2, dtype=torch.int32)])


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_trtllm_marshalling(fake_flashinfer, case):
    x = _cpu_inputs(case)
    # fp8 also quantizes q (e4m3, ~3 significant bits), which bounds the output error there.
    _check("flashinfer_trtllm", x, tol_out=0.08 if x.kv_cache.dtype == torch.float8_e4m3fn else None)


@pytest.mark.parametrize("case", ["q1", "fp8"])
def test_xqa_marshalling(fake_flashinfer, case):
    x = _cpu_inputs(case, num_heads=128)
    _check("flashinfer_xqa", x, tol_out=0.08 if case == "fp8" else None)


def test_sparse_padding_anywhere(fake_flashinfer):
    """-1 in the middle of a row: compaction keeps the valid slots' order and counts."""
    idx = torch.tensor([[5, -1, 7, -1, 2], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 99]], dtype=torch.int32)
    compacted, counts = common.compact_sparse(idx, capacity=64)
    assert counts.tolist() == [3, 0, 4]
    assert compacted.tolist() == [[5, 7, 2, 0, 0], [0, 0, 0, 0, 0], [1, 2, 3, 4, 0]]
    x = _cpu_inputs("sparse")
    x.sparse_indices = x.sparse_indices.flip(1).contiguous()  # padding first
    _check("flashinfer_fa3", x)
    _check("flashinfer_trtllm", x)


OPS = [("flashinfer_fa3", "q2"), ("flashinfer_trtllm", "sparse")]  # a host-planned and a device-prepared pair


@pytest.mark.parametrize("name,case", OPS)
def test_opcheck_plan_and_run(fake_flashinfer, name, case):
    x = _cpu_inputs(case, num_heads=2)
    backend = get_backend(name)
    plan_op, run_op = backend.plan_op(), backend.compiled_op()
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(plan_op, x.args(), test_utils=utils)
    plan = plan_op(*x.args())
    torch.library.opcheck(run_op, (*x.args(), plan), test_utils=utils)


def test_plan_op_is_cudagraph_unsafe_and_table_prepare_is_not():
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no torch.Tag.cudagraph_unsafe")
    assert torch.Tag.cudagraph_unsafe in get_backend("flashinfer_fa3").plan_op().tags
    assert torch.Tag.cudagraph_unsafe not in get_backend("flashinfer_trtllm").plan_op().tags


def test_import_is_lazy():
    """No backend module imports flashinfer at module level (``import mla_inductor`` stays lean; the lean
    import itself is tested in test_contract.py): every ``import flashinfer`` sits inside a function."""
    import ast
    import importlib

    for name in ("_flashinfer_common", "flashinfer_fa2", "flashinfer_fa3", "flashinfer_trtllm", "flashinfer_xqa"):
        module = importlib.import_module(f"mla_inductor.backends.{name}")
        tree = ast.parse(open(module.__file__).read())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] == "flashinfer" for n in names), (name, ast.dump(node))


# ----------------------------------------------------------------------------- GPU

def _gpu_backend_or_skip(name, x):
    backend = get_backend(name)
    why = backend.unavailable_reason()
    if why:
        pytest.skip(f"{name}: {why}")
    from mla_inductor.contract import check_decode_args

    cap = torch.cuda.get_device_capability()
    why = backend.supports(check_decode_args(*x.args()), cap)
    if why:
        pytest.skip(f"{name} on SM{cap[0]}{cap[1]}: {why}")
    return backend


def _poison_allocator():
    """Leave NaNs in the caching allocator's free blocks, so outputs a kernel forgets to write are NaN."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


GPU_CASES = {
    "bf16_q1_h16": dict(seq_lens=[0, 1, 63, 64, 65, 200, 1000], num_heads=16),
    "bf16_q1_h128": dict(seq_lens=[0, 1, 64, 128, 129, 777], num_heads=128),
    "bf16_q2_h16": dict(seq_lens=[0, 1, 2, 64, 65, 300], num_heads=16, q_per_seq=2),
    "bf16_q2_h128": dict(seq_lens=[1, 2, 129, 513], num_heads=128, q_per_seq=2),
    "fp8_q1_h16": dict(seq_lens=[0, 1, 64, 65, 400], num_heads=16, fmt="fp8_e4m3"),
    "fp8_q1_h128": dict(seq_lens=[1, 64, 1000], num_heads=128, fmt="fp8_e4m3"),
    "fp8_q2_h128": dict(seq_lens=[0, 1, 2, 65, 700], num_heads=128, q_per_seq=2, fmt="fp8_e4m3"),
    "sparse_h16": dict(seq_lens=[0, 1, 64, 300, 2000], num_heads=16, topk=128),
    "sparse_h128_q2": dict(seq_lens=[1, 65, 2000], num_heads=128, topk=256, q_per_seq=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("name", NAMES)
def test_gpu_matches_reference(name, case):
    x = make_decode_inputs(**GPU_CASES[case], device="cuda", seed=11)
    backend = _gpu_backend_or_skip(name, x)
    ref_out, ref_lse = mla_inductor.paged_decode_reference(*x.args())
    for _ in range(2):  # the second call replans the cached wrapper
        _poison_allocator()
        out, lse = backend.decode(*x.args())
        torch.cuda.synchronize()
        err_out, err_lse = relative_error(out, ref_out), relative_error(lse, ref_lse)
        tol = TOLERANCE[torch.bfloat16] * (5 if name in ("flashinfer_trtllm", "flashinfer_xqa")
                                           and x.kv_cache.dtype == torch.float8_e4m3fn else 1)
        assert err_out < tol and err_lse < 1e-3, (name, case, err_out, err_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer_fa3", "flashinfer_fa2"])
def test_gpu_compiled(name):
    import mla_inductor.lowering  # noqa: F401 - installs the pass
    from torch._inductor.utils import run_and_get_code

    x = make_decode_inputs([0, 1, 65, 300], num_heads=16, q_per_seq=2, device="cuda", seed=5)
    _gpu_backend_or_skip(name, x)
    two_layers = two_layer_step(x.softmax_scale)
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)
    torch._dynamo.reset()
    with mla_inductor.prefer_backends(name):
        (a, b, lse), codes = run_and_get_code(torch.compile(two_layers, fullgraph=True), *args)
    code = "\n".join(codes)
    fi = name.split("_")[1]
    assert f"run_{fi}" in code and code.count(f"plan_{fi}.default(") == 1, code[-3000:]
    # paged_decode reads no lse: the out-only run; every op called without the dispatcher (_library.define_op),
    # each run by its call site's own callable (static sizes: the wrapper's key found once per site)
    assert f"= extern_kernels.mla_direct.mla_flashinfer.plan_{fi}.default(" in code, code[-3000:]
    for op in (f"run_{fi}_out", f"run_{fi}"):
        assert f"= extern_kernels.mla_direct.mla_flashinfer.{op}.site_default_" in code, (op, code[-3000:])
    ref_a, _ = mla_inductor.paged_decode_reference(*x.args())
    ref_b, ref_lse = mla_inductor.paged_decode_reference(x.q_nope * 0.5, *x.args()[1:])
    assert relative_error(a, ref_a) < TOLERANCE[torch.bfloat16]
    assert relative_error(b, ref_b) < TOLERANCE[torch.bfloat16] and relative_error(lse, ref_lse) < 1e-3


@pytest.mark.gpu
def test_gpu_cudagraph_replay_sees_new_plan():
    """reduce-overhead: the plan runs outside the captured graph, the run inside reads the fresh plan."""
    import mla_inductor.lowering  # noqa: F401

    x = make_decode_inputs([1000] * 4, num_heads=16, device="cuda", seed=7)
    _gpu_backend_or_skip("flashinfer_fa3", x)
    scale = x.softmax_scale

    def step(q_nope, q_pe, cache, block_table, seq_lens, kv_scale):
        return torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, cache, block_table, seq_lens, scale, kv_scale)

    torch._dynamo.reset()
    with mla_inductor.prefer_backends("flashinfer_fa3"):
        fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        for lens in ([5, 300, 64, 1000], [6, 1, 0, 999], [64, 65, 700, 3], [7, 301, 65, 1000]):
            seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, seq_lens, x.kv_scale)
            out, lse = fn(*args)
            out, lse = out.clone(), lse.clone()
            ref_out, ref_lse = mla_inductor.paged_decode_reference(*args[:5], scale, x.kv_scale)
            assert relative_error(out, ref_out) < TOLERANCE[torch.bfloat16], lens
            assert relative_error(lse, ref_lse) < 1e-3, lens


@pytest.mark.gpu
def test_gpu_eager_calls_in_a_users_capture_run_on_a_device_planned_kernel():
    """Eager calls captured with torch.cuda.graph: where FA3 would take them uncaptured (B <= 16), the capture
    gets a backend scheduling on the device, and replays with new lengths stay right; FA3 preferred in a
    capture is refused with an error, not replayed with the capture's plan."""
    x = make_decode_inputs([1000, 5, 300, 64], num_heads=16, device="cuda", seed=9)
    _gpu_backend_or_skip("flashinfer_fa3", x)
    args = list(x.args())
    assert mla_inductor.backend_for_call(*args).backend == "flashinfer_fa3"  # uncaptured eager: FA3
    torch.ops.mla.paged_decode(*args)
    with mla_inductor.prefer_backends("triton"):
        torch.ops.mla.paged_decode(*args)  # compiles the kernel the capture will take, outside it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.mla.paged_decode(*args)
    for lens in ([7, 63, 1, 64], [1024, 1, 320, 0]):  # within each sequence's pages (1024, 64, 320, 64 slots)
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = mla_inductor.paged_decode_reference(*args)[0]
        assert relative_error(out, want) < TOLERANCE[torch.bfloat16], lens
    with mla_inductor.prefer_backends("flashinfer_fa3"), pytest.raises(RuntimeError, match="cannot run inside a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.ops.mla.paged_decode(*args)


# ----------------------------------------------------------------------------- empty-row masking kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=[pytest.mark.gpu] if DEV == "cuda" else [])
                                   for d in (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("Q,copy_lse,zero_out", [(1, False, True), (2, True, True), (2, True, False), (1, True, False)])
def test_finish_rows_touches_only_empty_rows(dtype, Q, copy_lse, zero_out):
    """The Triton epilogue (CUDA; the interpreter without a GPU) vs torch: lse copied from a [B, H, Q]
    kernel layout, -inf and (optionally) out 0 on rows that see nothing, other rows of out untouched."""
    from mla_inductor.kernels.empty_rows import finish_rows

    g = torch.Generator().manual_seed(5)
    B, H, L = 4, 5, 1100  # L * H spans several blocks, H is not a power of two
    T = B * Q
    out, lse = torch.randn(T, H, L, generator=g).to(dtype), torch.randn(T, H, generator=g)
    kernel_lse = torch.randn(B, H, Q, generator=g)  # FlashMLA's layout
    counts = torch.tensor([3, 0, 1, 0, 0, 9, 2, 7][:T], dtype=torch.int32)
    empty = counts == 0
    want_out, want_lse = out.clone(), kernel_lse.transpose(1, 2).reshape(T, H).clone() if copy_lse else lse.clone()
    if zero_out:
        want_out.masked_fill_(empty[:, None, None], 0)
    want_lse.masked_fill_(empty[:, None], float("-inf"))
    got_out, got_lse = out.to(DEV), lse.to(DEV)
    finish_rows(got_out, got_lse, (counts > 0).to(DEV) if Q == 2 else counts.to(DEV),
                lse_src=kernel_lse.to(DEV).transpose(1, 2) if copy_lse else None, zero_out=zero_out)
    assert torch.equal(got_out.cpu(), want_out) and torch.equal(got_lse.cpu(), want_lse)


@pytest.mark.parametrize("overrides", [dict(q_per_seq=4, num_heads=16), dict(q_per_seq=2, num_heads=63)])
@pytest.mark.parametrize("name", ["flashinfer_fa2", "flashinfer_fa3"])
def test_fa_accepts_more_queries_per_sequence_where_measured_right(name, overrides, cuda_13):
    assert get_backend(name).supports(problem(**overrides), CAPS["SM90"]) is None
