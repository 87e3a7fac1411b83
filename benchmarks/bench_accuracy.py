"""How accurate each backend is: relative error vs the fp32 reference, per cache format and FP8 query mode.

    python benchmarks/bench_accuracy.py [--out DIR]

For each case (random DeepSeek-V3-shaped data, and the same with a large-magnitude rope part in q and in
the cache) and each cache format (bf16, fp8_e4m3, fp8_ds_mla; dense, and top-k sparse), every backend
that can run the call on this GPU decodes it eagerly, and its output and lse are compared with
``paged_decode_reference`` (fp32 math) on the same stored cache: ``err`` is the backend's own error.
``err vs bf16 cache`` compares with the reference on the bf16 cache of the same values, so it adds what
the cache format itself costs.

Backends that compute with q in e4m3 (``quantized_query_op``: FlashMLA's dense FP8 kernel) run in every
query mode: ``e4m3 q, measured scale`` (amax per call, ``allow_fp8_query``), ``e4m3 q, static scale`` (a
q_scale calibrated on other activations of the same distribution, 25% headroom) and ``e4m3 q, static
scale 1/16 of calibrated`` (an uncalibrated scale: q saturates). Every other backend keeps q as given
(``bf16 q``). The markdown table is the one docs/backends.md shows. ``--out DIR`` writes
bench_accuracy.md and bench_accuracy.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback

import report
import torch

from mla_inductor.backends import availability, device_capability, get_backend
from mla_inductor.cache import encode_tokens, fp8_scale_for
from mla_inductor.contract import check_decode_args
from mla_inductor.reference import paged_decode_reference
from mla_inductor.testing import make_decode_inputs, relative_error

L, R = 512, 64
ROPE_SCALE = 8.0  # "large rope": q_pe and the cache's rope part this many times larger than the latent
CASES = (  # name, seq_lens (B sequences), heads, q per sequence
    ("B=16 H=128", [1, 63, 64, 65, 300, 1000, 2048, 4096] * 2, 128, 1),
    ("B=8 H=16 Q=2", [2, 64, 129, 700, 1500, 2500, 3000, 4096], 16, 2),
)
TOPK = 2048
FORMATS = ("bf16", "fp8_e4m3", "fp8_ds_mla")
RECORDS: list = []


def case_inputs(seq_lens, heads: int, q_per_seq: int, fmt: str, rope_scale: float, topk=None, seed: int = 0,
                device: str = "cuda"):
    """DecodeInputs in ``fmt``, and the same values in a bf16 cache: one draw of fp32 values, the rope part
    (q's and the cache's) times ``rope_scale``, then encoded."""
    x = make_decode_inputs(seq_lens, num_heads=heads, q_per_seq=q_per_seq, fmt="fp32", q_dtype=torch.bfloat16,
                           topk=topk, device=device, seed=seed)
    values = x.kv_cache.clone()
    values[..., L:] *= rope_scale
    x.q_pe = (x.q_pe.float() * rope_scale).to(torch.bfloat16)
    one = torch.ones(1, device=device)
    scale = fp8_scale_for(values) if fmt == "fp8_e4m3" else one
    bf16 = dataclasses.replace(x, kv_cache=encode_tokens(values, "bf16", one), kv_scale=one)
    return dataclasses.replace(x, kv_cache=encode_tokens(values, fmt, scale), kv_scale=scale.float()), bf16


def calibrated_q_scale(heads: int, rope_scale: float, seed: int, device: str = "cuda") -> torch.Tensor:
    """What a user would measure offline: amax of other queries of the same distribution / 448, +25%."""
    other = make_decode_inputs([64] * 8, num_heads=heads, q_per_seq=4, device=device, seed=seed)
    q = torch.cat([other.q_nope.float(), other.q_pe.float() * rope_scale], -1)
    return (q.abs().amax() * 1.25 / 448).reshape(1)


def query_modes(backend, problem, q_scale):
    """(label, q_scale or None, opted in) for each way this backend may treat the query."""
    if backend.quantized_query_op(dataclasses.replace(problem, fp8_query=True)) is None:
        return [("bf16 q", None, False)]
    return [("e4m3 q, measured scale", None, True), ("e4m3 q, static scale", q_scale, True),
            ("e4m3 q, static scale 1/16 of calibrated", q_scale / 16, True)]


def measure(label: str, x, bf16, capability, q_scale) -> None:
    problem = check_decode_args(*x.args())
    ref_out, ref_lse = paged_decode_reference(*x.args())
    ref_bf16 = paged_decode_reference(*bf16.args())[0]
    fmt = problem.cache_format
    for name, why in availability().items():
        backend = get_backend(name)
        for mode, scale, opted_in in query_modes(backend, problem, q_scale) if why is None else []:
            judged = dataclasses.replace(problem, fp8_query=opted_in)
            if backend.supports(judged, capability) is not None:
                continue
            row = dict(case=label, cache=fmt, sparse=problem.sparse, backend=name, query=mode)
            try:
                out, lse = backend.decode_with_q_scale(*x.args(), scale)
                row.update(err=relative_error(out, ref_out), lse_err=relative_error(lse, ref_lse),
                           err_vs_bf16_cache=relative_error(out, ref_bf16))
                origin = backend.loaded_from()
                if origin:
                    row["kernels"] = origin
            except Exception as e:  # noqa: BLE001 - a backend that fails here is reported, not fatal
                traceback.print_exc()
                row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            RECORDS.append(row)
            report.progress("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "kernels"))


def _fmt(value):
    return f"{value:.2e}" if isinstance(value, float) else str(value)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report.add_out_argument(p)
    args = p.parse_args(argv)
    report.require_gpu("bench_accuracy.py")
    capability = device_capability(torch.device("cuda"))
    env = report.environment(("flashinfer", "flash_mla", "vllm"))
    report.progress(f"# {report.environment_line(env)}")
    for rope_scale, data in ((1.0, "random"), (ROPE_SCALE, f"rope x{ROPE_SCALE:g}")):
        for name, seq_lens, heads, q_per_seq in CASES:
            q_scale = calibrated_q_scale(heads, rope_scale, seed=17)
            for fmt in FORMATS:
                for topk in (None, TOPK):
                    label = f"{name} {data}"
                    report.progress(f"## {label} {fmt} {'sparse top-k ' + str(topk) if topk else 'dense'}")
                    x, bf16 = case_inputs(seq_lens, heads, q_per_seq, fmt, rope_scale, topk)
                    measure(label, x, bf16, capability, q_scale)
    columns = ["case", "cache", "sparse", "backend", "query", "err", "lse_err", "err_vs_bf16_cache", "failed"]
    markdown = "\n".join([f"Relative error vs the fp32 reference on the same data, {report.environment_line(env)}",
                          "", report.markdown_table(columns, RECORDS)])
    print(markdown, flush=True)
    report.write_results(args.out, "bench_accuracy", markdown, {"environment": env, "rows": RECORDS})


if __name__ == "__main__":
    main()
