"""What every benchmark shares: the GPU check, the environment line, timing (and a step's bookkeeping and
our op's step of back-to-back calls), and writing results (--out)."""

from __future__ import annotations

import contextlib
import cProfile
import json
import pstats
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import timing

D_CKV = 512  # kv_lora_rank: q_nope's width in the benchmarks' DeepSeek-V3 shapes


def require_gpu(script: str) -> None:
    """Exit with a clear message (not a traceback) where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times GPU kernels and needs a CUDA GPU; torch.cuda.is_available() is False "
                         f"here (torch {torch.__version__}). Nothing was run.")


def environment(extra_libraries: tuple[str, ...] = ()) -> dict:
    """The device and the library versions a result depends on."""
    from mla_inductor.backends import library_versions

    versions = library_versions(("triton",) + tuple(extra_libraries))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            **{name: version for name, version in versions.items() if version}}


def environment_line(env: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in env.items())


def median_ms(fn) -> float:
    """Median time of a call on the GPU, as the peers are timed (``timing.median_ms``: do_bench, warmup 25, rep 200)."""
    return timing.median_ms(fn)


def parse_cases(text: str) -> list[tuple[int, int, str]]:
    """``--cases`` text, "BxH:fmt,..." (fmt "bf16" when left out), as [(B, H, fmt)]."""
    cases = []
    for item in text.split(","):
        shape, _, fmt = item.partition(":")
        B, H = (int(x) for x in shape.split("x"))
        cases.append((B, H, fmt or "bf16"))
    return cases


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.2f}"
    return str(value).replace("|", "/")


def write_results(out_dir: Optional[str], name: str, markdown: str, data: dict) -> None:
    """``<out_dir>/<name>.md`` and ``<out_dir>/<name>.json`` (nothing without ``--out``). The JSON starts with the
    command that made it (``command``), as benchmarks/results_page.py shows it beside the table."""
    if not out_dir:
        return
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.md").write_text(markdown + "\n")
    data = {"command": shlex.join(["python", *sys.argv]), **data}
    (path / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path / (name + '.md')} and {path / (name + '.json')}", flush=True)


def add_out_argument(parser) -> None:
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write the results to DIR as markdown and JSON (default: print only)")


def progress(message: str) -> None:
    print(message, flush=True)


def mark_new_step(seq_lens: torch.Tensor, host_lens: torch.Tensor) -> None:
    """Leave seq_lens as a decode step's bookkeeping leaves it (``PagedLatentCache.reserve``): written (its
    version counter moves, so no plan of the previous step is reused) and its host copy registered. The
    values stay, so every step times the same work."""
    torch.autograd.graph.increment_version(seq_lens)
    import mla_inductor

    mla_inductor.register_host_lengths(seq_lens, host_lens)


def mark_static(tensors) -> None:
    """CUDA-graph trees copy every graph input whose address may change into a static buffer at each replay;
    KV caches (hundreds of MB) and the step's shared tensors are marked static, as PagedLatentCache does."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t)


@contextlib.contextmanager
def lowered_afresh():
    """Inductor's FX-graph and AOT-autograd caches bypassed: a graph served from them runs no pass (records no
    decision) and may have been compiled under another setting (e.g. the value-check policy)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def query_views(qs: list) -> list:
    """``(q_nope, q_pe)`` views of each [T, H, 576] query, made once: a step over them (``decode_calls(...,
    views=True)``) takes its calls' halves as a model hands them to the op, and as the peers' direct steps take
    theirs (``peers.split_query``, made once outside their loops), instead of slicing them in every call."""
    return [(q[..., :D_CKV], q[..., D_CKV:]) for q in qs]


def decode_calls(scale: float, views: bool = False):
    """Our op's step of back-to-back decode calls sharing one page table, call i on query i and cache
    i % len(caches) (``peers.back_to_back_inputs``, the inputs the peers' ``direct_step`` reads); q_nope / q_pe
    are slices of one [T, H, 576] query (the layout the kernels read), made in each call, or with ``views`` the
    step's queries are ``query_views`` pairs made before it."""

    def step(qs, caches, block_table, seq_lens, kv_scale, sparse_indices=None, q_scale=None):
        halves = qs if views else query_views(qs)
        return [torch.ops.mla.paged_decode(q_nope, q_pe, caches[i % len(caches)], block_table, seq_lens, scale,
                                           kv_scale, sparse_indices, q_scale)
                for i, (q_nope, q_pe) in enumerate(halves)]

    return step


# The host-side events a step should not have (a wait for the device, a copy) whose callers step_profile lists.
WAITS_AND_COPIES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "aten::_to_copy")


def step_profile(run, device: str, steps: int = 3, rows: int = 25, callers: tuple[str, ...] = WAITS_AND_COPIES,
                 sort_by: str = "cpu_time_total") -> str:
    """torch.profiler's table of ``steps`` calls of ``run`` (host and device time per op, by ``sort_by``: host
    time by default, ``"device_time_total"`` for the kernels): where a step's milliseconds go (a host plan, a
    copy, a device->host sync such as cudaStreamSynchronize, launches between graphs), then who called each event
    named in ``callers`` (``event_callers``). The profiler's session slows later CUDA calls of the process: run it
    after all timings."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad(), torch_profile(activities=activities, with_stack=bool(callers)) as prof:
        for _ in range(steps):
            run()
        if device == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by=sort_by, row_limit=rows)
    return table + ("\n" + event_callers(prof.events(), callers) if callers else "")


_TORCH_DIR = str(Path(torch.__file__).resolve().parent).replace("\\", "/") + "/"


def _is_torch_frame(frame: str) -> bool:
    """Whether a profiler frame name ("path.py(line): function") is torch's own code: a file under the torch
    package's directory, wherever it is installed (site-packages, a source checkout), or a relative torch/ path."""
    path = frame.split(".py(")[0].replace("\\", "/")
    return path.startswith(_TORCH_DIR) or path.startswith("torch/") or "/site-packages/torch/" in path


def event_callers(events, names: tuple[str, ...], frames: int = 4) -> str:
    """For each profiler event named in ``names``: how many there were, their host µs, and the innermost
    ``frames`` Python frames outside torch that led to it (the profiler's parent chain), most frequent first."""
    grouped: dict[tuple, list[float]] = {}
    for event in events:
        if event.name not in names:
            continue
        # The event's recorded stack where the profiler keeps one, else its parents (Python function events).
        frame_names, parent = list(event.stack or []), event.cpu_parent
        while not event.stack and parent is not None:
            frame_names.append(parent.name)
            parent = parent.cpu_parent
        chain = [f[-90:] for f in frame_names if ".py(" in f and not _is_torch_frame(f)][:frames]
        grouped.setdefault((event.name, " <- ".join(chain) or "(no Python caller recorded outside torch)"), []).append(
            event.cpu_time_total)
    if not grouped:
        return f"callers: no {', '.join(names)} events"
    lines = ["callers (count, host us in all, event <- innermost Python frames outside torch):"]
    for (name, chain), times in sorted(grouped.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {len(times):4d} x {sum(times):10.1f} us  {name} <- {chain}")
    return "\n".join(lines)


def prompt_kernel_log():
    """A dispatch mode recording, for each ``mla.prefill_attention`` call it sees, the prompt kernel that ran
    (``prefill.prefill_kernel`` on its arguments, asked after the call: a FlashInfer kernel whose first call
    failed reads as sdpa) in ``.kernels`` and the call's (q, k, v) in ``.args``; the op itself runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mla_inductor.prefill import prefill_kernel

    class PromptKernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels: list[str] = []
            self.args: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.mla.prefill_attention.default:
                self.kernels.append(prefill_kernel(*args[:3]))
                self.args.append(tuple(args[:3]))
            return out

    return PromptKernels()


def _where(file: str, line: int, name: str) -> str:
    """A profile entry's function, its file named from the package or library it belongs to."""
    if file == "~":
        return name  # a built-in
    parts = file.replace("\\", "/").split("/")
    for root in ("mla_inductor", "torch", "triton", "flashinfer", "flash_mla", "vllm", "benchmarks"):
        if root in parts:
            parts = parts[len(parts) - parts[::-1].index(root) - 1:]
            break
    else:
        parts = parts[-1:]
    return f"{'/'.join(parts)}:{line}({name})"


def profile_of(run: Callable[[], object], before: Callable[[], None], steps: int, calls: int, top: int = 18,
               by: str = "own") -> str:
    """The top functions of a cProfile over ``steps`` steps, by own time (``by="cumulative"``: by cumulative time),
    as µs per op call (``calls`` op calls per step; cProfile's own overhead inflates every number about alike:
    compare the rows, not with timings taken without it)."""
    profiler = cProfile.Profile()
    for _ in range(steps):
        before()
        profiler.enable()
        run()
        profiler.disable()
    stats = pstats.Stats(profiler).stats
    per_call = steps * calls
    column = {"own": 2, "cumulative": 3}[by]
    rows = sorted(stats.items(), key=lambda item: -item[1][column])[:top]
    lines = [f"{'own us/call':>11} {'cum us/call':>11} {'calls/call':>10}  function"]
    for (file, line, name), (_, ncalls, own, cumulative, _) in rows:
        lines.append(f"{own * 1e6 / per_call:11.2f} {cumulative * 1e6 / per_call:11.2f} {ncalls / per_call:10.2f}  "
                     f"{_where(file, line, name)}")
    return "\n".join(lines)
