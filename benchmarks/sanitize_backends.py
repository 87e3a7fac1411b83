"""Every GPU backend's decode (and the CUDA cache writer) on edge cases, for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/sanitize_backends.py [--out DIR] [--backends a,b]
        [--cases SUBSTRING]

Each case is a valid call whose unused memory is a trap: the cache holds exactly the pages the batch
uses (no spare page to read past), unused block-table entries hold 2147480000 (or -1), rows nothing
attends hold NaN, sparse rows are padded with -1 and some list nothing; zero lengths, a query longer
than its sequence, pages of 1 and 16 tokens, odd lengths, 1 to 128 heads, every cache format. Then the
calls with nothing (or little) to attend, ``mla_inductor.testing.EDGE_CASES`` in every cache format:
lengths all 0 with and without cache pages, a zero-width block table, an empty batch, Q > 1 over short
sequences, all-padding and K = 0 sparse rows. Each backend runs each call the way eager dispatch does
(``decode``) and the way a compiled graph does (its plan and decode ops); calls whose kernel takes an
e4m3 query (FlashMLA's dense FP8) are made as if the caller opted in. A kernel that dereferences what the
call does not attend reads outside an allocation (memcheck reports it; the CUDA caching allocator is
switched off here so every tensor is its own allocation) or returns NaN or a wrong value (this script
reports it: each output is compared with the reference on the same GPU, and rows that see nothing must be
exactly out 0, lse -inf).

Expected: "0 errors" in compute-sanitizer's ERROR SUMMARY and every row "ok" or "skipped (reason)"; the
exit status is 1 when a row is a MISMATCH or an ERROR. Without a CUDA GPU the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

# Before CUDA initialises: every tensor its own cudaMalloc, so an out-of-bounds read is outside any allocation.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

HUGE_PAGE_ID = 2147480000

# name -> make_decode_inputs arguments (L=512, R=64) plus what fills unused block-table entries and
# how many sparse rows list nothing.
CASES = {
    "lens_0_1_63_64_65_300": dict(seq_lens=[0, 1, 63, 64, 65, 300], num_heads=16),
    "all_zero_lengths": dict(seq_lens=[0, 0], num_heads=16),
    "one_token_one_row": dict(seq_lens=[1], num_heads=16),
    "q4_longer_than_sequence": dict(seq_lens=[1, 3, 0], num_heads=16, q_per_seq=4),
    "mtp_q2_h128": dict(seq_lens=[4096, 1, 700], num_heads=128, q_per_seq=2),
    "page1_odd_lengths": dict(seq_lens=[0, 17, 33, 97], num_heads=16, page_size=1),
    "page16_l1025_l1027_h32": dict(seq_lens=[1025, 1027, 3], num_heads=32, page_size=16, table_fill=-1),
    "heads_3": dict(seq_lens=[140, 20], num_heads=3),
    "heads_63_q2": dict(seq_lens=[140, 20, 0], num_heads=63, q_per_seq=2),
    "heads_126_fp16": dict(seq_lens=[140, 71], num_heads=126, fmt="fp16", q_dtype=torch.float16),
    "wide_table_b128": dict(seq_lens=[(7 * b) % 90 for b in range(128)], num_heads=16, max_pages=64),
    "fp8_e4m3_h128": dict(seq_lens=[0, 65, 4096], num_heads=128, fmt="fp8_e4m3"),
    "fp8_ds_mla_h64_q2": dict(seq_lens=[0, 65, 300], num_heads=64, q_per_seq=2, fmt="fp8_ds_mla"),
    "sparse_fp8_ds_mla_topk64": dict(seq_lens=[512, 30, 0], num_heads=64, fmt="fp8_ds_mla", topk=64,
                                     empty_rows=1),
    "sparse_fp8_ds_mla_topk2048_q2": dict(seq_lens=[2046, 700], num_heads=128, q_per_seq=2, fmt="fp8_ds_mla",
                                          topk=2048, empty_rows=1),
    "sparse_bf16_topk128_h16": dict(seq_lens=[140, 20, 300], num_heads=16, topk=128, empty_rows=1),
}


def build(spec: dict, seed: int, device="cuda"):
    """The case's inputs on ``device``, unused memory filled as the module docstring says."""
    from mla_inductor.testing import make_decode_inputs

    spec = dict(spec)
    table_fill, empty_rows = spec.pop("table_fill", HUGE_PAGE_ID), spec.pop("empty_rows", 0)
    x = make_decode_inputs(**spec, spare_pages=0, device=device, seed=seed)
    if x.sparse_indices is not None and empty_rows:
        x.sparse_indices[-empty_rows:] = -1
    return trap_unused_memory(x, table_fill)


def build_edge(name: str, fmt: str, seed: int, device="cuda"):
    """``EDGE_CASES[name]`` with a ``fmt`` cache on ``device``, unused memory filled the same way."""
    from mla_inductor.testing import edge_case_inputs

    return trap_unused_memory(edge_case_inputs(name, fmt, device=device, seed=seed), HUGE_PAGE_ID)


def trap_unused_memory(x, table_fill: int):
    """In place: unused block-table entries ``table_fill``, every cache row the call does not attend NaN."""
    device = x.kv_cache.device
    page = x.kv_cache.shape[1]
    cols = torch.arange(x.block_table.shape[1], device=device)
    x.block_table.masked_fill_(cols[None, :] * page >= x.seq_lens.long()[:, None], table_fill)
    attended = torch.zeros(x.kv_cache.shape[0] * page, dtype=torch.bool, device=device)
    if x.sparse_indices is not None:
        listed = x.sparse_indices.long().flatten()
        attended[listed[listed >= 0]] = True
    else:
        for b, n in enumerate(x.seq_lens.tolist()):
            t = torch.arange(n, device=device)
            attended[x.block_table[b, t // page].long() * page + t % page] = True
    idle = (~attended).nonzero().flatten()
    if x.kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        x.kv_cache.view(torch.uint8)[idle // page, idle % page] = 0xFF  # NaN bytes (e4m3, fp32 scales, bf16 rope)
    else:
        x.kv_cache[idle // page, idle % page] = float("nan")
    return x


def judge(out, lse, ref_out, ref_lse) -> str:
    """'ok' or 'MISMATCH', with the errors: gross errors only (precision is the tests' business), and rows
    that see nothing exactly out 0, lse -inf."""
    from mla_inductor.testing import relative_error

    err_out, err_lse = relative_error(out, ref_out), relative_error(lse, ref_lse)
    empty = torch.isinf(ref_lse)
    exact = out.shape == ref_out.shape and bool((out[empty] == 0).all()) and bool((lse[empty] == ref_lse[empty]).all())
    bad = not (err_out < 0.1 and err_lse < 0.02 and exact)
    return f"{'MISMATCH' if bad else 'ok'} (out error {err_out:.1e}, lse error {err_lse:.1e}" + \
        ("" if exact else ", a row that sees nothing is not out 0 / lse -inf") + ")"


def check_decode(backend, x, all_paths: bool = False) -> str:
    """``backend.decode`` against the reference; ``all_paths``: also every op a compiled graph calls."""
    from mla_inductor.reference import paged_decode_reference
    from mla_inductor.testing import backend_call_paths

    paths = backend_call_paths(backend, x.args()) if all_paths else [("decode", *backend.decode(*x.args()))]
    if x.q_nope.is_cuda:
        torch.cuda.synchronize()
    # The reference on the CPU: the same math, but memcheck does not instrument host code (on the GPU its many
    # small kernels took most of a run's time under the sanitizer).
    host_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in x.args()]
    ref_out, ref_lse = paged_decode_reference(*host_args)
    results = {what: judge(out.cpu(), lse.cpu(), ref_out, ref_lse) for what, out, lse in paths}
    worst = next((r for r in results.values() if not r.startswith("ok")), results["decode"])
    return worst if len(paths) == 1 else f"{worst} [{', '.join(f'{w} {r.split()[0]}' for w, r in results.items())}]"


def all_cases(device="cuda") -> dict:
    """name -> (make(seed) -> inputs on ``device``, whether to run the compiled graph's ops too): CASES,
    then every edge case in every cache format (``edge:<case>-<format>``), those through every path."""
    from mla_inductor.testing import edge_case_grid

    cases = {name: (lambda seed, spec=spec: build(spec, seed, device), False) for name, spec in CASES.items()}
    for name, fmt in edge_case_grid():
        cases[f"edge:{name}-{fmt}"] = (lambda seed, name=name, fmt=fmt: build_edge(name, fmt, seed, device), True)
    return cases


def check_cache_append() -> str:
    """The CUDA writer with skipped (-1) slots, the cache's first and last slots, every format."""
    from mla_inductor.cache import decode_tokens

    results = []
    for fmt, (L, R) in (("bf16", (512, 64)), ("fp8_e4m3", (512, 64)), ("fp8_ds_mla", (512, 64))):
        dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}[fmt]
        width = 656 if fmt == "fp8_ds_mla" else L + R
        cache = torch.zeros(3, 16, width, dtype=dtype, device="cuda")
        slots = torch.tensor([-1, 0, 47, -1, 20], dtype=torch.int32, device="cuda")
        kv_c = torch.randn(5, L, device="cuda", dtype=torch.bfloat16)
        k_pe = torch.randn(5, R, device="cuda", dtype=torch.bfloat16)
        kv_scale = torch.full((1,), 0.02, device="cuda")
        torch.ops.mla.cache_append(cache, kv_c, k_pe, slots, kv_scale)
        torch.cuda.synchronize()
        rows = decode_tokens(cache.reshape(48, width)[slots[[1, 2, 4]].long()], kv_scale)
        ok = bool(torch.isfinite(rows).all())
        results.append(f"{fmt} {'ok' if ok else 'NON-FINITE'}")
    return ", ".join(results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="directory for sanitize.md and sanitize.json")
    p.add_argument("--backends", default=None, help="comma-separated backend names (default: every GPU backend)")
    p.add_argument("--cases", default=None, help="run only the cases whose name contains this")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("sanitize_backends: no CUDA GPU visible (torch.cuda.is_available() is False); nothing to run")
        return 0

    import mla_inductor  # noqa: F401 - registers the ops
    from mla_inductor.backends import device_capability, get_backend, registered_backends
    from mla_inductor.contract import check_decode_args

    names = args.backends.split(",") if args.backends else [n for n in registered_backends() if get_backend(n).libraries]  # the reference needs no library: not a GPU kernel
    capability = device_capability(torch.device("cuda"))
    print(f"GPU {torch.cuda.get_device_name()} (SM{capability[0]}{capability[1]}), torch {torch.__version__}",
          flush=True)
    cases = all_cases()
    if args.cases:
        cases = {name: case for name, case in cases.items() if args.cases in name}
    rows, failures = [], 0
    for name in names:
        backend = get_backend(name)
        why = backend.unavailable_reason()
        for i, (case, (make, all_paths)) in enumerate(cases.items()):
            t0 = time.perf_counter()
            if why is not None:
                result = f"skipped ({why})"
            else:
                x = make(i)
                # Calls whose kernel takes an e4m3 query (FlashMLA's dense FP8) are made as if the caller opted in.
                problem = dataclasses.replace(check_decode_args(*x.args()), fp8_query=True)
                reason = backend.supports(problem, capability)
                try:
                    result = f"skipped ({reason})" if reason is not None else check_decode(backend, x, all_paths)
                except Exception as e:  # noqa: BLE001 - report and go on to the next case
                    result = f"ERROR {type(e).__name__}: {e}"
            failures += result.startswith(("ERROR", "MISMATCH"))
            rows.append(dict(backend=name, case=case, result=result))
            print(f"{name:18s} {case:40s} {result}  [{time.perf_counter() - t0:.1f} s]", flush=True)
            if why is not None:
                break  # one line says the backend is not installed
    try:
        append = check_cache_append()
    except Exception as e:  # noqa: BLE001
        append = f"ERROR {type(e).__name__}: {e}"
    failures += "ERROR" in append or "NON-FINITE" in append
    rows.append(dict(backend="cache_append", case="skipped and edge slots", result=append))
    print(f"{'cache_append':18s} {'skipped and edge slots':40s} {append}", flush=True)
    print(f"{failures} failing rows; compute-sanitizer's ERROR SUMMARY counts the memory errors")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sanitize.json").write_text(json.dumps(rows, indent=1))
        lines = ["| backend | case | result |", "|---|---|---|"]
        lines += [f"| {r['backend']} | {r['case']} | {r['result']} |" for r in rows]
        (args.out / "sanitize.md").write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
