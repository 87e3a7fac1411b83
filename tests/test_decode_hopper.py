"""The Gluon kernel for SM90 (mla_inductor/kernels/decode_hopper.py) on a CPU machine: Gluon has no
interpreter, so these tests compile it for SM90 with the installed Triton (what a Hopper user's first call
does) and check when DecodeLaunch chooses it. Its values are checked on the GPU in test_triton_kernels.py
(``test_gpu_hopper_kernel*``)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from benchmark_modules import load_benchmark

pytest.importorskip("triton")

from mla_inductor.kernels import decode as dk  # noqa: E402
from mla_inductor.kernels import decode_hopper as dh  # noqa: E402

needs_gluon = pytest.mark.skipif(not dh.HAVE_GLUON, reason="this Triton has no Gluon Hopper ops "
                                                          "(triton.experimental.gluon...hopper) or an older Gluon")
H100_SHARED_BYTES = 232448  # the most shared memory one program may use on SM90


def _compile_for_sm90(kv_mode: int, block_n: int, stages: int, splits: int, qdt: str, sparse: bool = False,
                      kernel: str = "gluon_sm90", ints=None):
    return load_benchmark("kernel_sass").compile_for_sm90(kv_mode, block_n, stages, splits, qdt, sparse, kernel, dh,
                                                          ints=ints)


CASES = [("gluon_sm90", kv_mode, qdt, tiling, splits, False)
         for kv_mode, qdt in [(0, "bf16"), (0, "fp16"), (1, "bf16"), (2, "bf16")]
         for tiling in dh.TILINGS for splits in (1, 3)]
# Sparse calls (a slot list per row): the two formats DeepSeek's sparse attention stores, default tiling.
CASES += [("gluon_sm90", kv_mode, "bf16", dh.TILINGS[0], splits, True) for kv_mode in (0, 2) for splits in (1, 3)]
# The 16-head variant: fp8 caches, dense and sparse.
CASES += [("gluon_sm90_narrow", kv_mode, "bf16", (dh.NARROW_BLOCK_N, 1), splits, sparse) for kv_mode in (1, 2)
          for splits in (1, 3) for sparse in (False, True)]


def _compile_all() -> dict:
    """Compile every case; {case: {shared, wgmma, cp16} or {error}} (run in a process without the interpreter)."""
    report = {}
    for kernel, kv_mode, qdt, (block_n, stages), splits, sparse in CASES:
        key = f"{kernel}-{kv_mode}-{qdt}-{block_n}-{stages}-{splits}-{sparse}"
        try:
            k = _compile_for_sm90(kv_mode, block_n, stages, splits, qdt, sparse, kernel)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            report[key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
            continue
        ptx = k.asm["ptx"]
        report[key] = {"shared": k.metadata.shared, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                       "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", ptx)),
                       "ld16": len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)),
                       "prefetch": len(re.findall(r"prefetch\.global\.L2", ptx)),
                       "setmaxnreg": len(re.findall(r"setmaxnreg", ptx)),
                       "mbarrier_wait": len(re.findall(r"mbarrier\.try_wait", ptx))}
    return report


def _in_a_compiling_process(call: str):
    """The JSON result of ``call`` (an expression over this module, as ``t``) evaluated in a process of its own
    without Triton's interpreter: the CPU suite runs it (TRITON_INTERPRET=1), under which nothing compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_decode_hopper as t; "
            f"print('REPORT' + json.dumps({call}))")
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT")), None)
    assert line is not None, f"the compile process failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(line[len("REPORT"):])


@pytest.fixture(scope="module")
def compiled():
    return _in_a_compiling_process("t._compile_all()")


@pytest.mark.slow
@needs_gluon
@pytest.mark.parametrize("kernel,kv_mode,qdt,tiling,splits,sparse", CASES)
def test_kernel_compiles_for_sm90(compiled, kernel, kv_mode, qdt, tiling, splits, sparse):
    got = compiled[f"{kernel}-{kv_mode}-{qdt}-{tiling[0]}-{tiling[1]}-{splits}-{sparse}"]
    assert "error" not in got, got.get("error")
    # The 16-head variant is written for two programs per SM.
    per_sm = 2 if kernel == "gluon_sm90_narrow" else 1
    assert got["shared"] * per_sm <= H100_SHARED_BYTES, f"{got['shared']} bytes of shared memory"
    assert got["wgmma"] > 0, "the products must be wgmma"
    if kv_mode == 0:
        assert got["cp16"] > 0, "cache rows must be copied 16 bytes at a time"
    else:
        # e4m3 and fp8_ds_mla tiles go through registers to be widened: 16-byte loads, prefetched into L2 ahead.
        assert got["ld16"] > 0, "cache rows must be loaded 16 bytes at a time"
        assert got["prefetch"] > 0, "the tile after the next must be prefetched into L2"
    if kernel == "gluon_sm90" and kv_mode != 0:
        # Widened by a warpgroup of its own, handing tiles over through mbarriers, with its registers given back
        # to the consumers (setmaxnreg).
        assert got["setmaxnreg"] > 0 and got["mbarrier_wait"] > 0, \
            "fp8 tiles must be widened by a warp-specialized producer"


# Sparse calls listing one slot a row, one split: Triton's JIT compiles an int argument equal to 1 in as a constant,
# and with TOPK = 1 every bound of the key loop is then constant, which Triton 3.6 failed to compile (an assertion
# in its LLVM lowering, "PassManager::run failed": found by the GPU fuzz test).
TOPK_ONE = [("gluon_sm90", kv_mode) for kv_mode in (0, 1, 2)] + [("gluon_sm90_narrow", kv_mode) for kv_mode in (1, 2)]


def _compile_topk_one() -> dict:
    """{kernel-kv_mode: None, or the compile's error} for a sparse call of TOPK = 1 as Triton's JIT compiles it."""
    report = {}
    for kernel, kv_mode in TOPK_ONE:
        block_n, stages = load_benchmark("kernel_sass").default_tiling(kernel, dh)
        try:
            _compile_for_sm90(kv_mode, block_n, stages, 1, "bf16", True, kernel, ints={"TOPK": 1})
            report[f"{kernel}-{kv_mode}"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            report[f"{kernel}-{kv_mode}"] = f"{type(e).__name__}: {str(e)[-2000:]}"
    return report


@pytest.mark.slow
@needs_gluon
def test_sparse_calls_of_one_slot_a_row_compile_for_sm90():
    # Whatever this Triton's compiler does with a constant TOPK, the kernels take it as a run-time value.
    for kernel, _ in dh.KERNELS.values():
        assert kernel.params[kernel.arg_names.index("TOPK")].do_not_specialize
    assert _in_a_compiling_process("t._compile_topk_one()") == {f"{k}-{m}": None for k, m in TOPK_ONE}


def test_gluon_kernels_need_warp_specialize_taking_a_list():
    # Triton 3.5's Gluon took the partitions' arguments apart (and could not call _reinterpret from a kernel):
    # there HAVE_GLUON is false and SM90 runs the tl.dot kernel instead of failing to compile at the first call.
    from types import SimpleNamespace

    from mla_inductor._compat import gluon_kernels_compile

    def current(functions_and_args, worker_num_warps, worker_num_regs=None, _semantic=None, _generator=None):
        pass

    def triton_3_5(default_args, default_partition, worker_args, worker_partitions, worker_num_warps,
                   worker_num_regs, _semantic=None, _generator=None):
        pass

    assert gluon_kernels_compile(SimpleNamespace(warp_specialize=current))
    assert not gluon_kernels_compile(SimpleNamespace(warp_specialize=triton_3_5))
    assert not gluon_kernels_compile(SimpleNamespace())


def test_a_triton_from_3_6_on_has_the_gluon_kernels():
    # Not skipped where HAVE_GLUON is false: that is what this checks (the compile tests above skip without it).
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 6):
        pytest.skip(f"Triton {triton.__version__} predates the Gluon forms the kernels use (checked above)")
    assert dh.HAVE_GLUON, "a Triton from 3.6 on must compile the Gluon kernels (see _compat.gluon_kernels_compile)"


def test_config_on_cpu_is_the_tl_dot_kernel():
    cfg = dk.choose_config(4, 128, 4096, 0, torch.device("cpu"))
    assert cfg.kernel == "tl_dot"


def test_config_rejects_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel"):
        dk.DecodeConfig(64, 64, 1, 8, 2, kernel="cutlass")
    cfg = dk.DecodeConfig(64, 64, 3, 8, 2, kernel="gluon_sm90")
    assert cfg.with_kernel("tl_dot").kernel == "tl_dot" and cfg.with_kernel("tl_dot").num_splits == 3


@pytest.mark.parametrize("q,kv,mode,L,R,stride,expected", [
    (torch.bfloat16, torch.bfloat16, dk._KV_PLAIN, 512, 64, 576, True),
    (torch.float16, torch.float16, dk._KV_PLAIN, 512, 64, 576, True),
    (torch.bfloat16, torch.float8_e4m3fn, dk._KV_FP8, 512, 64, 576, True),
    (torch.bfloat16, torch.float16, dk._KV_PLAIN, 512, 64, 576, False),  # q and cache differ
    (torch.float32, torch.float32, dk._KV_PLAIN, 512, 64, 576, False),
    (torch.bfloat16, torch.bfloat16, dk._KV_PLAIN, 256, 32, 288, False),
    (torch.bfloat16, torch.uint8, dk._KV_DS, 512, 64, 656, True),
    (torch.bfloat16, torch.bfloat16, dk._KV_PLAIN, 512, 64, 584, False),  # row stride not a multiple of 16
])
def test_which_calls_the_gluon_kernel_covers(q, kv, mode, L, R, stride, expected):
    # Sparse or dense makes no difference: the kernel reads a slot list as it reads a block table.
    assert dk._hopper_kernel_covers("gluon_sm90", q, kv, mode, L, R, stride) is expected


@pytest.mark.parametrize("kv,mode,stride,expected", [(torch.float8_e4m3fn, dk._KV_FP8, 576, True),
                                                     (torch.uint8, dk._KV_DS, 656, True),
                                                     (torch.bfloat16, dk._KV_PLAIN, 576, False)])
def test_which_calls_the_narrow_gluon_kernel_covers(kv, mode, stride, expected):
    assert dk._hopper_kernel_covers("gluon_sm90_narrow", torch.bfloat16, kv, mode, 512, 64, stride) is expected


@pytest.mark.parametrize("H,kv_mode,expected", [(128, dk._KV_PLAIN, "gluon_sm90"), (40, dk._KV_FP8, "gluon_sm90"),
                                                (128, dk._KV_DS, "gluon_sm90"), (32, dk._KV_PLAIN, "gluon_sm90"),
                                                (16, dk._KV_FP8, "gluon_sm90_narrow"),
                                                (16, dk._KV_DS, "gluon_sm90_narrow"), (8, dk._KV_FP8, "gluon_sm90_narrow"),
                                                (16, dk._KV_PLAIN, "gluon_sm90"), (32, dk._KV_FP8, "gluon_sm90"),
                                                (17, dk._KV_DS, "gluon_sm90")])
def test_default_config_on_an_sm90_gpu(monkeypatch, H, kv_mode, expected):
    # What choose_config gives on an SM90 GPU with Gluon, seen from a CPU machine: the Gluon kernel at 64 heads
    # per program from 17 heads up, at the tl.dot kernel's 64-head tiling, which must be the Gluon kernel's default
    # tiling; the 16-head variant for fp8 caches at 16 heads or fewer; 16-bit caches at 16 heads the 64-head kernel
    # at this size (8 rows x 4096 keys).
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(dk, "_sm_count", lambda device: 132)
    cfg = dk._choose_config_cached.__wrapped__(8, H, 4096, kv_mode, "cuda", 0)
    assert cfg.kernel == expected
    if expected == "gluon_sm90":
        assert (cfg.block_n, cfg.num_stages) == dh.TILINGS[0] and cfg.block_h == dh.HEADS_PER_PROGRAM
        assert cfg.num_warps == dh.NUM_WARPS
    if expected == "gluon_sm90_narrow":
        assert (cfg.block_h, cfg.block_n, cfg.num_warps) == (dh.NARROW_BLOCK_H, dh.NARROW_BLOCK_N,
                                                             dh.NARROW_NUM_WARPS)


@pytest.mark.parametrize("T,kv_len,expected", [(1, 4096, "gluon_sm90"), (128, 4096, "gluon_sm90"),
                                               (16, 32768, "gluon_sm90"), (32, 32768, "tl_dot"),
                                               (128, 4097, "tl_dot"), (1, 1 << 20, "tl_dot")])
@pytest.mark.parametrize("H", [16, 8])
def test_few_heads_on_a_16_bit_cache_take_the_wide_kernel_up_to_a_size(monkeypatch, T, kv_len, expected, H):
    # Dense bf16/fp16 at 16 heads or fewer: the 64-head Gluon kernel up to 2^19 (query row, key) pairs, then the
    # tl.dot kernel at its own 16-head tiling (at the HBM floor there, two programs per SM). fp8 caches keep the
    # narrow kernel.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(dk, "_sm_count", lambda device: 132)
    cfg = dk._choose_config_cached.__wrapped__(T, H, kv_len, dk._KV_PLAIN, "cuda", 0)
    assert cfg.kernel == expected
    assert cfg.block_h == (dh.HEADS_PER_PROGRAM if expected == "gluon_sm90" else 16)
    assert dk._choose_config_cached.__wrapped__(T, H, kv_len, dk._KV_FP8, "cuda", 0).kernel == "gluon_sm90_narrow"
    # Sparse calls (kv_len is then the top-k) keep the tl.dot kernel at any size.
    assert dk._choose_config_cached.__wrapped__(T, H, kv_len, dk._KV_PLAIN, "cuda", 0, True).kernel == "tl_dot"


def test_a_narrow_config_the_call_cannot_take_falls_back_to_the_tl_dot_kernels_own(monkeypatch):
    # A bf16 cache at 16 heads with the 16-head Gluon variant asked for (on an SM90 GPU, as far as DecodeLaunch
    # can tell): the tl.dot kernel at its own tiling.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    c = dict(q_nope=torch.randn(2, 16, 512, dtype=torch.bfloat16), q_pe=torch.randn(2, 16, 64, dtype=torch.bfloat16),
             kv_cache=torch.randn(4, 16, 576, dtype=torch.bfloat16), block_table=torch.tensor([[0, 1], [2, 3]],
                                                                                              dtype=torch.int32),
             seq_lens=torch.tensor([20, 30], dtype=torch.int32), softmax_scale=0.1, kv_scale=None)
    launch = dk.DecodeLaunch(**c, config=dk.DecodeConfig(16, 64, 1, 4, 1, kernel="gluon_sm90_narrow"))
    assert launch.config.kernel == "tl_dot"
    assert launch.config.block_n == dk.tl_dot_config(2, 16, 32, torch.device("cpu")).block_n


@pytest.fixture
def as_on_an_sm90_gpu(monkeypatch):
    """DecodeLaunch on CPU tensors configured as on a 132-SM SM90 GPU (the Gluon kernels chosen, GPU tilings)."""
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(dk, "_sm_count", lambda device: 132)
    gpu_tiling = dk.tl_dot_config
    monkeypatch.setattr(dk, "tl_dot_config",
                        lambda T, H, kv_len, device: gpu_tiling(T, H, kv_len, torch.device("cuda")))
    dk._choose_config_cached.cache_clear()
    yield
    dk._choose_config_cached.cache_clear()


@pytest.mark.parametrize("H,fallback_block_h", [(128, 64), (32, 32)])
def test_the_wide_kernels_fallback_is_the_tl_dot_kernels_best_tiling(as_on_an_sm90_gpu, H, fallback_block_h):
    # A call the wide Gluon kernel is asked for but cannot take (here a cache of another latent width) runs the
    # tl.dot kernel: at 128 heads at the given config's tiling and splits (the tiling is the tl.dot kernel's own
    # there), at 32 heads at the tl.dot kernel's own 32-head tiling, not the 64-head one half of which would be empty.
    cfg = dk.gluon_config("gluon_sm90", 2, H, 64, torch.device("cuda", 0))
    c = dict(q_nope=torch.randn(2, H, 256, dtype=torch.bfloat16), q_pe=torch.randn(2, H, 64, dtype=torch.bfloat16),
             kv_cache=torch.randn(4, 16, 320, dtype=torch.bfloat16), block_table=torch.tensor([[0, 1], [2, 3]],
                                                                                              dtype=torch.int32),
             seq_lens=torch.tensor([20, 30], dtype=torch.int32), softmax_scale=0.1, kv_scale=None)
    launch = dk.DecodeLaunch(**c, config=cfg)
    assert launch.config.kernel == "tl_dot" and launch.config.block_h == fallback_block_h
    if H == 128:
        assert repr(launch.config) == repr(cfg.with_kernel("tl_dot"))


@pytest.mark.parametrize("H,kv_mode", [(128, dk._KV_FP8), (64, dk._KV_PLAIN), (32, dk._KV_DS), (16, dk._KV_DS),
                                       (8, dk._KV_FP8)])
def test_gluon_config_is_what_choose_config_picks(monkeypatch, H, kv_mode):
    # gluon_config (what benchmarks force where the default is the tl.dot kernel) gives, where choose_config picks a
    # Gluon kernel, exactly its choice.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(dk, "_sm_count", lambda device: 132)
    picked = dk._choose_config_cached.__wrapped__(8, H, 4096, kv_mode, "cuda", 0)
    assert picked.kernel != "tl_dot"
    assert repr(dk.gluon_config(picked.kernel, 8, H, 4096, torch.device("cuda", 0))) == repr(picked)  # every field


def test_gluon_config_at_32_heads_and_an_unknown_kernel(monkeypatch):
    monkeypatch.setattr(dk, "_sm_count", lambda device: 132)
    narrow = dk.gluon_config("gluon_sm90_narrow", 128, 32, 4096, torch.device("cuda", 0))
    wide = dk.gluon_config("gluon_sm90", 128, 32, 4096, torch.device("cuda", 0))
    assert (narrow.block_h, narrow.kernel) == (dh.NARROW_BLOCK_H, "gluon_sm90_narrow")  # two head blocks
    assert (wide.block_h, wide.kernel) == (dh.HEADS_PER_PROGRAM, "gluon_sm90")  # one, half of it empty
    with pytest.raises(ValueError, match="kernel"):
        dk.gluon_config("tl_dot", 128, 32, 4096, torch.device("cuda", 0))


# The split merge's launch shapes (DecodeLaunch._use): (BLOCK_S, BLOCK_L, ONE_STEP) at L = 512.
MERGE_SHAPES = sorted({(block_s, block_l, ns <= block_s)
                       for pairs in (1, 16, 32, 64, 128, 256, 511, 512, 4096) for ns in (2, 5, 16, 20, 32, 64, 128, 130)
                       for block_s, block_l in [dk.merge_tile(pairs, ns, 512)]})  # every tile picked at L = 512


def _merge_spills(shapes=MERGE_SHAPES) -> dict:
    """ptxas's spill bytes for the split merge compiled for SM90 in each launch shape ({shape: bytes or error})."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    sig = {"POUT": "*fp32", "PLSE": "*fp32", "OUT": "*bf16", "LSE": "*fp32", "NUM_SPLITS": "i32",
           "L": "constexpr", "BLOCK_S": "constexpr", "BLOCK_L": "constexpr", "ONE_STEP": "constexpr"}
    report = {}
    for block_s, block_l, one_step in shapes:
        key = f"{block_s}-{block_l}-{one_step}"
        try:
            const = dict(L=512, BLOCK_S=block_s, BLOCK_L=block_l, ONE_STEP=one_step)
            k = triton.compile(ASTSource(dk._mla_merge_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=4))
            with tempfile.TemporaryDirectory() as d:
                ptx = os.path.join(d, "merge.ptx")
                with open(ptx, "w") as f:
                    f.write(k.asm["ptx"])
                done = subprocess.run([_ptxas_for_sm90(get_ptxas), "-arch=sm_90a", "-v", ptx, "-o",
                                       os.path.join(d, "m.o")], capture_output=True, text=True)
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
            report[key] = spills[0] if done.returncode == 0 and spills else f"ptxas: {done.stderr[-500:]}"
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            report[key] = f"{type(e).__name__}: {str(e)[:1000]}"
    return report


def _ptxas_for_sm90(get_ptxas) -> str:
    """The ptxas Triton compiles SM90 code with: ``get_ptxas(arch)`` from Triton 3.6 on, ``get_ptxas()`` in 3.5."""
    try:
        return get_ptxas(90).path
    except TypeError:
        return get_ptxas().path


@pytest.mark.slow
def test_the_split_merge_compiles_for_sm90_without_spilling():
    # Holding every split's whole row at once spills at 128 splits (docs/kernels.md, "The split merge"); the last
    # shape is that layout, so the check itself is seen to catch a spill.
    report = _in_a_compiling_process(f"t._merge_spills({MERGE_SHAPES + [(128, 512, True)]!r})")
    old_way = report.pop("128-512-True")
    assert report == {f"{s}-{c}-{o}": 0 for s, c, o in MERGE_SHAPES}, report
    assert isinstance(old_way, int) and old_way > 0, old_way


@pytest.mark.parametrize("B,S", [(2, 4096), (8, 1024), (1, 4096)])
def test_the_chosen_wide_kernels_fallback_takes_the_tl_dot_kernels_own_splits(as_on_an_sm90_gpu, B, S):
    # No config given: where the wide kernel is chosen but cannot take the call, the tl.dot kernel runs at its own
    # split count (its rule leaves the partials out), not the Gluon kernel's, which is slower for the tl.dot kernel
    # at these shapes (docs/kernels.md, "The split rule").
    pages = S // 16
    c = dict(q_nope=torch.randn(B, 128, 256, dtype=torch.bfloat16), q_pe=torch.randn(B, 128, 64, dtype=torch.bfloat16),
             kv_cache=torch.randn(B * pages, 16, 320, dtype=torch.bfloat16),
             block_table=torch.arange(B * pages, dtype=torch.int32).reshape(B, pages),
             seq_lens=torch.full((B,), S, dtype=torch.int32), softmax_scale=0.1, kv_scale=None)
    launch = dk.DecodeLaunch(**c)
    own = dk.tl_dot_config(B, 128, S, torch.device("cuda"))
    wide = dk.gluon_config("gluon_sm90", B, 128, S, torch.device("cuda"))
    assert launch.config.kernel == "tl_dot"
    assert repr(launch.config) == repr(own)
    assert wide.num_splits != own.num_splits  # the Gluon kernel's count: what the fallback took before
