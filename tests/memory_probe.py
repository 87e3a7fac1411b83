"""Peak extra resident memory of one ``mla.paged_decode`` call on CPU, measured in a fresh process.

    python tests/memory_probe.py eager|compiled H,B,S [H,B,S ...]   -> one JSON line per configuration

DeepSeek-V3 dims (L=512, R=64), a bf16 cache of 64-token pages holding exactly the batch's contexts,
bf16 queries. For each configuration: a warm-up call with the same batch and heads on a short context
(the same chunk shapes, so libraries have sized their buffers; in compiled mode the first one compiles
the one graph, with symbolic sizes, that serves every configuration), then build the inputs, hand freed
heap back to the system (malloc_trim), reset the process's peak-RSS mark (/proc/self/clear_refs), call,
and report VmHWM - VmRSS before the call: everything the call needed beyond its inputs, its output
included. Run with MALLOC_MMAP_THRESHOLD_ set (tests/test_cpu_memory.py sets 1 MiB) so large
tensors are mapped and unmapped one by one and the peak RSS is the peak of live tensors.
"""

import ctypes
import json
import sys

import torch


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _inputs(H, B, S, L=512, R=64, page=64):
    g = torch.Generator().manual_seed(0)
    P = B * S // page
    kv_cache = torch.randn(P, page, L + R, generator=g, dtype=torch.bfloat16)
    block_table = torch.randperm(P, generator=g).int().view(B, S // page)
    seq_lens = torch.full((B,), S, dtype=torch.int32)
    q_nope = torch.randn(B, H, L, generator=g).bfloat16()
    q_pe = torch.randn(B, H, R, generator=g).bfloat16()
    return q_nope, q_pe, kv_cache, block_table, seq_lens, (L + R) ** -0.5, torch.ones(1)


def main(mode: str, configs: list[tuple[int, int, int]]) -> None:
    import mla_inductor.lowering  # noqa: F401 - registers the ops, installs the pass

    def decode(*args):
        return torch.ops.mla.paged_decode(*args)

    # One graph for every configuration: sizes symbolic, the (constant) softmax scale specialised.
    torch._dynamo.config.specialize_float = True
    step = torch.compile(decode, fullgraph=True, dynamic=True) if mode == "compiled" else decode
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    for H, B, S in configs:
        with torch.no_grad():
            step(*_inputs(H, B, 256))  # warm-up: several chunks of the measured call's shapes
        args = _inputs(H, B, S)
        with torch.no_grad():
            if trim is not None:
                trim(0)
            before = _status_bytes("VmRSS")
            _reset_peak()
            out = step(*args)
            peak = _status_bytes("VmHWM")
        print(json.dumps(dict(mode=mode, H=H, B=B, S=S, extra_bytes=peak - before,
                              out_bytes=out.numel() * out.element_size())), flush=True)
        del args, out


if __name__ == "__main__":
    main(sys.argv[1], [tuple(int(v) for v in c.split(",")) for c in sys.argv[2:]])
