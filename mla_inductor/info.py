"""What mla-inductor sees on this machine: ``python -m mla_inductor.info [--markdown]``.

Prints the GPU, the optional libraries and their versions (and which are outside the ranges the selection
table was measured with), each backend's availability (with the reason when it is not usable) and where its
kernels were loaded from (FlashMLA: which package serves each of its modes), whether measured selection
(``mla_inductor.tuning``) times new problem classes here and what it has stored, and which backend typical
DeepSeek calls get here, from the table or from a measurement (with the measured times).
``--markdown`` prints instead the machine-independent backend matrix kept in docs/backends.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import Optional

import torch

from mla_inductor.backends import (
    availability,
    device_capability,
    get_backend,
    library_versions,
    registered_backends,
)
from mla_inductor import tuning
from mla_inductor.contract import DecodeProblem
from mla_inductor.selection import TABLE, select_backend

CAPABILITIES = {"cpu": None, "SM80": (8, 0), "SM89": (8, 9), "SM90": (9, 0), "SM100": (10, 0), "SM120": (12, 0)}
FORMATS = ("bf16", "fp8_e4m3", "fp8_ds_mla")


def example_problem(device_type: str, fmt: str, sparse: bool, heads: int, page_size: int, q_per_seq: int = 1,
                    batch: Optional[int] = None, fp8_query: bool = False):
    return DecodeProblem(device_type=device_type, cache_format=fmt, q_dtype=torch.bfloat16, num_heads=heads,
                         kv_lora_rank=512, rope_dim=64, page_size=page_size, sparse=sparse,
                         topk=2048 if sparse else None, q_per_seq=q_per_seq, batch=batch, fp8_query=fp8_query)


def fp8_query_rows(available: dict[str, Optional[str]]):
    """(device, format, sparse, heads, page_size, chosen backend) where a call that opted in to an e4m3
    query (a static q_scale, or allow_fp8_query) gets another backend than ``matrix_rows`` lists."""
    for (dev, cap), fmt, sparse, heads, page in itertools.product(CAPABILITIES.items(), FORMATS, (False, True),
                                                                  (16, 128), (64, 16)):
        device = "cpu" if cap is None else "cuda"
        default, opted_in = (select_backend(example_problem(device, fmt, sparse, heads, page, fp8_query=q8), cap,
                                            available=available, preference=()).backend for q8 in (False, True))
        if opted_in != default:
            yield dev, fmt, sparse, heads, page, opted_in


def matrix_rows(available: dict[str, Optional[str]]):
    """(device, format, sparse, heads, page_size, batch, chosen backend, passed-over reasons) for a grid of
    calls; batch "any" (a dynamic or large B), plus a "1" row where a single sequence gets another backend."""
    for (dev, cap), fmt, sparse, heads, page in itertools.product(CAPABILITIES.items(), FORMATS, (False, True),
                                                                  (16, 128), (64, 16)):
        for batch in (None, 1):
            problem = example_problem("cpu" if cap is None else "cuda", fmt, sparse, heads, page, batch=batch)
            selection = select_backend(problem, cap, available=available, preference=())
            if batch is None:
                any_batch = selection.backend
            elif selection.backend == any_batch:
                continue
            yield dev, fmt, sparse, heads, page, batch or "any", selection.backend, selection.reasons


def _short(reason: str, width: int = 64) -> str:
    """A refusal cut to fit a table cell (``python -m mla_inductor.info`` prints it whole)."""
    return reason if len(reason) <= width else reason[:width - 1].rstrip() + "…"


def backend_matrix_markdown() -> str:
    """docs/backends.md's generated part: the table rows and what select_backend picks on each device,
    assuming every backend's library is installed."""
    lines = ["| row | device | cache | sparse | calls | preference order |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(TABLE, 1):
        lines.append(f"| {i} | {row.device} | {', '.join(row.formats)} | {'yes' if row.sparse else 'no'} | "
                     f"{row.applies_to()} | {' → '.join(row.order).removesuffix(' → reference')} |")
    lines += ["", "Every row ends with the reference. Why each row orders its backends (the figures behind each reason "
              "are on the results page):", ""]
    lines += [f"{i}. [{row.reason}](results.md#{row.anchor})" for i, row in enumerate(TABLE, 1)]
    lines += ["", "First matching row wins. Chosen backend for L=512, R=64, Q=1 (top-k 2048 when sparse), every "
              "library installed (batch 1 listed where it differs):", "",
              "| device | cache | sparse | H | page | B | backend | passed over |", "|---|---|---|---|---|---|---|---|"]
    everything = {name: None for name in registered_backends()}
    for dev, fmt, sparse, heads, page, batch, chosen, reasons in matrix_rows(everything):
        lines.append(f"| {dev} | {fmt} | {'yes' if sparse else 'no'} | {heads} | {page} | {batch} | {chosen} | "
                     f"{'; '.join(_short(r) for r in reasons) or '—'} |")
    lines += ["", "Calls that opted in to an e4m3 query (a static `q_scale`, or `allow_fp8_query()`), where the "
              "choice differs:", "", "| device | cache | sparse | H | page | backend |", "|---|---|---|---|---|---|"]
    for dev, fmt, sparse, heads, page, chosen in fp8_query_rows(everything):
        lines.append(f"| {dev} | {fmt} | {'yes' if sparse else 'no'} | {heads} | {page} | {chosen} |")
    return "\n".join(lines) + "\n"


def report() -> str:
    out = []
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cap = device_capability(device)
    gpu = f"{torch.cuda.get_device_name()} (SM{cap[0]}{cap[1]})" if cap else "none (CPU only)"
    out.append(f"GPU: {gpu}")
    out.append("libraries: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in library_versions(extra=("torch", "transformers")).items()))
    outside = tuning.untested_versions()
    if outside:
        out.append("outside the tested ranges: " + ", ".join(f"{n} {v}" for n, v in outside.items()))
    out += tuning_report(device.type, cap)
    avail = availability()
    out.append("backends:")
    for name, why in avail.items():
        out.append(f"  {name:<20} {'available' if why is None else 'unavailable: ' + why}")
    for name, why in avail.items():
        origin = get_backend(name).loaded_from() if why is None else None
        if origin:
            out.append(f"{name} kernels: {origin}")
    out.append(f"selection on this machine ({device.type}), L=512 R=64 Q=1:")
    for fmt, sparse, heads, page in itertools.product(FORMATS, (False, True), (16, 128), (64,)):
        problem = example_problem(device.type, fmt, sparse, heads, page)
        try:
            with tuning.lookups_only():  # what stored measurements say; nothing is timed here
                sel = select_backend(problem, cap)
            source = "table" if sel.measurement is None else f"timings {sel.measurement.describe()}"
            detail = f"{sel.backend} [{source}]" + (f"  (passed over: {'; '.join(sel.reasons)})" if sel.reasons
                                                      else "")
            opted_in = select_backend(dataclasses.replace(problem, fp8_query=True), cap, available=avail).backend
            if opted_in != sel.backend:
                detail += f"; with an e4m3 query allowed (q_scale or allow_fp8_query): {opted_in}"
        except RuntimeError as e:
            detail = f"none: {e}"
        out.append(f"  {fmt:<11} {'sparse' if sparse else 'dense ':<6} H={heads:<4} page={page}: {detail}")
    return "\n".join(out)


def tuning_report(device_type: str, capability) -> list[str]:
    """Lines saying whether measured selection times new classes here, why, and what it has stored."""
    try:
        mode = tuning.requested_mode()
    except ValueError as e:
        return [f"measured selection: {e}"]
    if device_type != "cuda":
        return [f"measured selection: off (no GPU; ${tuning.AUTOTUNE_ENV}={mode})"]
    why = tuning.why_auto(device_type, capability)
    timing = tuning.timing_allowed(device_type, capability)
    reason = {"0": "turned off", "1": "asked for", "all": "asked for, every usable backend",
              "auto": why or "the table was measured on this GPU class and these versions"}[mode]
    env = tuning.environment()
    path = tuning.results_file(env)
    lines = [f"measured selection (${tuning.AUTOTUNE_ENV}={mode}): new problem classes "
             f"{'are' if timing else 'are not'} timed ({reason}); results: {path}"]
    try:
        stored = tuning.read_results(path, env).get("results", {})
    except tuning.TuningCacheError as e:
        return lines + [f"  {e}"]
    for key, entry in stored.items():
        times = ", ".join(f"{n} {us:.1f} us" for n, us in entry["times"])
        lines.append(f"  {key}: {entry['winner']} ({times})")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the backend matrix for docs/backends.md")
    args = parser.parse_args(argv)
    print(backend_matrix_markdown() if args.markdown else report())


if __name__ == "__main__":
    main()
