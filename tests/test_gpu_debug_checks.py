"""GPU value checks in debug mode (MLA_INDUCTOR_DEBUG=1): device-side asserts, no host sync.

Compiled graphs check values on a GPU only in debug mode, with ``torch._assert_async`` (the check op the
pass inserts); eager calls do so too while a CUDA graph is being captured. A failed device assert
poisons the CUDA context, so the failing calls run in a subprocess. Skipped without a GPU.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mla_inductor  # noqa: F401
import mla_inductor.lowering  # noqa: F401 - registers mla::check_decode_values
from mla_inductor.testing import make_decode_inputs

pytestmark = pytest.mark.gpu

SMALL = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, page_size=64, q_dtype=torch.bfloat16, device="cuda")


def _inputs():
    return make_decode_inputs([70, 200], **SMALL)


def test_check_op_on_gpu_waits_for_nothing():
    x = _inputs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        torch.ops.mla.check_decode_values(x.q_nope, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale, None, None,
                                          "paged_decode")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_compiled_debug_graph_checks_values_and_is_capturable(monkeypatch):
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("MLA_INDUCTOR_DEBUG", "1")
    x = _inputs()
    torch._dynamo.reset()
    step = torch.compile(lambda *a: torch.ops.mla.paged_decode(*a), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        out, code = run_and_get_code(step, *x.args())
    assert "torch.ops.mla.check_decode_values" in code[0]
    torch.testing.assert_close(out, torch.ops.mla.paged_decode(*x.args()), rtol=1.6e-2, atol=1e-2)


def test_eager_debug_checks_inside_cuda_graph_capture(monkeypatch):
    monkeypatch.setenv("MLA_INDUCTOR_DEBUG", "1")
    x = _inputs()
    torch.ops.mla.paged_decode(*x.args())  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.mla.paged_decode(*x.args())
    graph.replay()
    torch.testing.assert_close(out, torch.ops.mla.paged_decode(*x.args()), rtol=1.6e-2, atol=1e-2)


BAD_CALL = """
import torch, mla_inductor
from mla_inductor.testing import make_decode_inputs
x = make_decode_inputs([70, 200], num_heads=16, kv_lora_rank=512, rope_dim=64, page_size=64,
                       q_dtype=torch.bfloat16, device="cuda")
step = torch.compile(lambda *a: torch.ops.mla.paged_decode(*a), fullgraph=True)
step(*x.args())
torch.cuda.synchronize()
print("good call ok", flush=True)
bad = list(x.args())
bad[4] = x.seq_lens + 10**6  # seq_lens past the block table's capacity
step(*bad)
torch.cuda.synchronize()
print("bad call passed", flush=True)
"""


def test_compiled_debug_graph_stops_a_bad_call_with_a_device_assert():
    env = {**os.environ, "MLA_INDUCTOR_DEBUG": "1"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(BAD_CALL)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert "good call ok" in result.stdout and "bad call passed" not in result.stdout, result.stdout
    assert result.returncode != 0 and "device-side assert" in result.stderr, result.stderr[-3000:]
