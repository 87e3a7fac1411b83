"""Measured selection: time the eligible backends the way a call will run, remember the winner on disk.

The selection table (``selection.TABLE``) ranks backends from measurements on a few GPUs and library
versions. Where those do not hold (another GPU class, library versions outside the tested ranges), or
wherever the user asks (``MLA_INDUCTOR_AUTOTUNE=1``), a call's backend is chosen by timing each eligible
one in the call's program shape (``timing.py``: a whole step captured in CUDA graphs, a step without CUDA
graphs or eager calls, a graph of one call) on a serving batch's varied lengths, several rounds, median;
backends within ``TIE`` of the fastest count as tied and the table's order decides among them, so a choice
does not flip between runs.

Results are kept per problem class (``class_key``: cache format, dense/sparse, heads, page size, batch
class, program kind, ...) in one JSON file per environment (``environment``: GPU model and the versions of
torch, triton and the backends' libraries) under ``cache_dir()``; a later process reads them and times
nothing, and the Inductor pass's cache key includes them (``tuning_key``). ``python -m mla_inductor.tune``
fills the file ahead of time and exports/imports it.

``MLA_INDUCTOR_AUTOTUNE``:

- unset (or ``auto``): time new classes on GPUs whose class the table has no measured rows for
  (``MEASURED_DEVICE_CLASSES``) and where a library's version is outside ``TESTED_VERSIONS``; elsewhere use
  stored results where there are some (from ``mla_inductor.tune``), else the table.
- ``1``: time new classes on any GPU, among the backends of the table's row.
- ``all``: the same among every usable backend that supports the call, the table's row or not (the table
  only breaks ties): how a GPU run checks the table (``benchmarks/bench_modes.py --tune``).
- ``0``: the table only; stored results are ignored.

Never on CPU (the reference is the only backend there). A user's preference (``prefer_backends``,
``MLA_INDUCTOR_BACKEND``) is taken as given, untimed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mla_inductor import backends
from mla_inductor._compat import environment_reader
from mla_inductor.contract import DecodeProblem
from mla_inductor.selection import (
    ONE_CALL_GRAPH,
    CallContext,
    Selection,
    batch_limits,
    consult_measurements,
    device_class,
    graph_kind,
    user_preference,
)

log = logging.getLogger(__name__)

AUTOTUNE_ENV = "MLA_INDUCTOR_AUTOTUNE"
LENGTHS_ENV = "MLA_INDUCTOR_TUNE_LENGTHS"
CACHE_DIR_ENV = "MLA_INDUCTOR_CACHE_DIR"
MODES = ("auto", "0", "1", "all")
LENGTHS = ("varied", "equal")

# Backends whose times differ by less than this fraction of the fastest are tied: the table's order decides.
TIE = 0.03
CALLS_PER_STEP = 8  # calls sharing one plan in a timed multi-call step (each on its own query and cache)
SEQ_LEN = 4096  # the longest sequence of a timed batch; varied lengths are drawn in [SEQ_LEN / 8, SEQ_LEN]
TOP_CLASS_BATCH = 128  # the batch timed for the class above every batch limit of the table

# Device classes the table's rows were measured on; elsewhere its order is a guess and tuning is on by default.
MEASURED_DEVICE_CLASSES = ("cpu", "sm90")
# The library versions the table was measured with (pyproject's extras name the supported ranges); a version
# outside turns tuning on by default. An absent library is no reason.
TESTED_VERSIONS: dict[str, str] = {
    "torch": ">=2.11,<2.12",
    "triton": ">=3.6,<3.7",
    "flashinfer": ">=0.6.14,<0.7",
    "flash_mla": ">=1.0,<1.1",
}
FILE_FORMAT = 1  # the version of the JSON layout below

_local = threading.local()
_configured: dict[str, str] = {}  # configure(): process-wide settings over the environment
_mode_env = environment_reader(AUTOTUNE_ENV)
_lengths_env = environment_reader(LENGTHS_ENV)


class TuningCacheError(RuntimeError):
    """A tuning file that cannot be read as one this package wrote (truncated, edited, another format)."""


@dataclass(frozen=True)
class ProgramShape:
    """How the timed calls run: ``kind`` (``selection.CAPTURED_STEP``, ``ONE_CALL_GRAPH`` or ``UNCAPTURED``),
    ``calls`` sharing one plan, whether ``captured`` in a CUDA graph, the ``batch`` timed, the longest
    sequence ``seq_len`` and whether lengths are ``varied`` (drawn in [seq_len / 8, seq_len]) or all equal."""

    kind: str
    calls: int
    captured: bool
    batch: int
    seq_len: int
    varied: bool


@dataclass(frozen=True)
class Measurement:
    """What a choice was measured as: microseconds per call for each backend timed (``times``, in the order
    tried), the ones that failed to run and why (``failed``), ``source`` ("measured" in this process, or
    "stored": read from ``file``), the class key and the shape timed."""

    times: tuple[tuple[str, float], ...]
    failed: tuple[tuple[str, str], ...]
    source: str
    file: str
    class_key: str
    shape: str

    def describe(self) -> str:
        times = ", ".join(f"{name} {us:.1f} us" for name, us in self.times)
        failed = "".join(f"; {name} failed: {why}" for name, why in self.failed)
        where = "measured in this process" if self.source == "measured" else f"stored in {self.file}"
        return f"{where} ({self.shape}): {times}{failed}"

    def as_json(self) -> dict:
        return {"times": [list(t) for t in self.times], "failed": [list(f) for f in self.failed],
                "source": self.source, "file": self.file, "class_key": self.class_key, "shape": self.shape}

    @classmethod
    def from_json(cls, data: dict) -> "Measurement":
        return cls(tuple((n, float(us)) for n, us in data["times"]), tuple((n, w) for n, w in data["failed"]),
                   data["source"], data["file"], data["class_key"], data["shape"])


# A timer: (problem, shape, backend names, device) -> for each name, its microseconds per call in each round,
# or a string saying why it could not run. ``timing.time_backends`` on a GPU; tests inject fakes.
Timer = Callable[[DecodeProblem, ProgramShape, Sequence[str], object], Mapping[str, object]]


# ----------------------------------------------------------------------------- when it is on

def configure(*, mode: Optional[str] = None, lengths: Optional[str] = None,
              cache_dir: Optional[str] = None) -> None:
    """Settings for the whole process that take precedence over the environment (a benchmark's or a tool's
    flags): ``mode`` one of ``MODES``, ``lengths`` one of ``LENGTHS``, ``cache_dir`` the results' folder."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"configure(mode={mode!r}): expected one of {', '.join(MODES)}")
    if lengths is not None and lengths not in LENGTHS:
        raise ValueError(f"configure(lengths={lengths!r}): expected one of {', '.join(LENGTHS)}")
    for key, value in (("mode", mode), ("lengths", lengths), ("cache_dir", cache_dir)):
        if value is not None:
            _configured[key] = value


def requested_mode() -> str:
    """``autotuning(...)`` if active, else ``configure(mode=...)``, else ``$MLA_INDUCTOR_AUTOTUNE`` ("auto"
    when unset): one of ``MODES``."""
    forced = getattr(_local, "forced", None)
    if forced is not None:
        return forced
    if "mode" in _configured:
        return _configured["mode"]
    value = (_mode_env() or "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"${AUTOTUNE_ENV}={value!r}: expected one of {', '.join(MODES)} (unset means auto)")
    return value


@contextlib.contextmanager
def autotuning(mode="1") -> Iterator[None]:
    """Tune in the block whatever ``$MLA_INDUCTOR_AUTOTUNE`` says: ``mode`` one of ``MODES`` (True = "1",
    False = "0")."""
    mode = {True: "1", False: "0"}.get(mode, mode) if isinstance(mode, bool) else str(mode)
    if mode not in MODES:
        raise ValueError(f"autotuning(mode={mode!r}): expected one of {', '.join(MODES)} or a bool")
    previous = getattr(_local, "forced", None)
    _local.forced = mode
    try:
        yield
    finally:
        _local.forced = previous


def autotune_enabled() -> bool:
    """Whether new problem classes are timed on this machine's current GPU (False without one)."""
    return timing_allowed(current_device_type(), current_capability())


def untested_versions(versions: Optional[Mapping[str, Optional[str]]] = None) -> dict[str, str]:
    """The installed libraries whose version is outside ``TESTED_VERSIONS``: name -> "version (tested: range)"."""
    if versions is None:
        versions = {k.removeprefix("version:"): v for k, v in environment().items() if k.startswith("version:")}
    outside = {}
    for name, spec in TESTED_VERSIONS.items():
        version = versions.get(name)
        if not version or version == "unknown version":
            continue
        try:
            release = Version(Version(version).base_version)  # 0.6.18.post1 and 2.11.0+cu130 are in range
        except InvalidVersion:
            outside[name] = f"{version} (unparsable; tested: {spec})"
            continue
        if release not in SpecifierSet(spec):
            outside[name] = f"{version} (tested: {spec})"
    return outside


def why_auto(device_type: str, capability, versions=None) -> Optional[str]:
    """Why tuning is on by default here (None: it is not): an untested GPU class or library version."""
    if device_type != "cuda":
        return None
    klass = device_class(device_type, capability)
    if klass not in MEASURED_DEVICE_CLASSES:
        return f"the selection table has no measured rows for {klass} (capability {capability})"
    outside = untested_versions(versions)
    if outside:
        return "library versions outside the tested ranges: " + ", ".join(f"{n} {v}" for n, v in outside.items())
    return None


def timing_allowed(device_type: str, capability) -> bool:
    """Whether a new problem class on this device may be timed now (the mode, and never on CPU)."""
    if device_type != "cuda":
        return False
    mode = requested_mode()
    if mode == "auto":
        return why_auto(device_type, capability) is not None
    return mode in ("1", "all")


def lengths() -> str:
    """The length distribution timed: ``$MLA_INDUCTOR_TUNE_LENGTHS`` ("varied", the default, or "equal")."""
    value = _configured.get("lengths") or (_lengths_env() or "varied").strip().lower()
    if value not in LENGTHS:
        raise ValueError(f"${LENGTHS_ENV}={value!r}: expected one of {', '.join(LENGTHS)}")
    return value


# ----------------------------------------------------------------------------- keys

def current_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def current_capability():
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def library_versions() -> dict[str, Optional[str]]:
    """torch's, triton's and every backend library's version (None: not installed)."""
    return backends.library_versions(extra=("torch", "triton"))


def environment() -> dict:
    """What decides the timings besides the call: the GPU model and capability, the library versions (read once
    per process: the file's name and every lookup depend on them)."""
    return dict(_environment())


@functools.lru_cache(maxsize=1)
def _environment() -> tuple:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return tuple({"gpu": gpu, "capability": list(current_capability() or ()),
                  **{f"version:{k}": v for k, v in sorted(library_versions().items())}}.items())


def environment_key(env: Mapping) -> str:
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def batch_class(batch: Optional[int]) -> tuple[str, int]:
    """The table's batch class of ``batch`` (its words, and the batch timed for it): "B<=8" for 5..8 when the
    table splits at 4 and 8; the class above every limit for a batch too large or unknown (None)."""
    limits = batch_limits()
    lower = 0
    for limit in limits:
        if batch is not None and batch <= limit:
            return (f"{lower}<B<={limit}" if lower else f"B<={limit}"), limit
        lower = limit
    return (f"B>{lower}" if lower else "any B"), max(TOP_CLASS_BATCH, lower + 1)


def program_shape(problem: DecodeProblem, context: Optional[CallContext]) -> ProgramShape:
    """The shape a call of ``problem`` in ``context`` (None: an eager call) is timed in."""
    kind = graph_kind(context)
    captured = context is not None and context.captured
    calls = 1 if kind == ONE_CALL_GRAPH else CALLS_PER_STEP
    return ProgramShape(kind, calls, captured, batch_class(problem.batch)[1], SEQ_LEN, lengths() == "varied")


def class_key(problem: DecodeProblem, context: Optional[CallContext], mode: str) -> str:
    """The problem class a measurement stands for: the call's properties but its batch (its class instead),
    the program kind, the length distribution and the candidates' scope ("table" row or "all")."""
    kind = graph_kind(context)
    captured = context is not None and context.captured
    q = str(problem.q_dtype).removeprefix("torch.")
    return (f"{problem.cache_format} {'sparse' if problem.sparse else 'dense'} q={q} H={problem.num_heads} "
            f"L={problem.kv_lora_rank} R={problem.rope_dim} page={problem.page_size} Q={problem.q_per_seq} "
            f"topk={problem.topk} fp8_query={problem.fp8_query} {batch_class(problem.batch)[0]} | {kind}"
            f"{' captured' if captured and kind == ONE_CALL_GRAPH else ''} | lengths={lengths()} | "
            f"candidates={'all' if mode == 'all' else 'table'}")


# ----------------------------------------------------------------------------- the files

def cache_dir() -> Path:
    """``$MLA_INDUCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/mla_inductor``, else ``~/.cache/mla_inductor``."""
    explicit = _configured.get("cache_dir") or os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mla_inductor"


def results_file(env: Mapping) -> Path:
    return cache_dir() / "selection" / f"{environment_key(env)}.json"


_files: dict = {}  # path -> ((mtime_ns, size), parsed contents): a file is parsed once per change


def _stat(path: Path):
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def _validated(data, path: Path, env: Optional[Mapping] = None) -> dict:
    """``data`` if it has this package's layout (and ``env``'s environment), else TuningCacheError naming the
    file."""
    def refuse(why: str):
        raise TuningCacheError(f"mla_inductor: the tuning file {path} is not usable ({why}); it was not used. "
                               f"Delete it (tuning then measures again) or set ${AUTOTUNE_ENV}=0 to use the "
                               f"selection table only.")

    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        refuse(f"not a format-{FILE_FORMAT} mla_inductor tuning file")
    if not isinstance(data.get("environment"), dict) or not isinstance(data.get("results"), dict):
        refuse("no 'environment' or 'results' object")
    if env is not None and data["environment"] != dict(env):
        refuse("it was written for another GPU or library versions than its name says")
    for key, entry in data["results"].items():
        try:
            assert isinstance(entry["winner"], str) and isinstance(entry["shape"], str)
            Measurement(tuple((str(n), float(us)) for n, us in entry["times"]),
                        tuple((str(n), str(w)) for n, w in entry.get("failed", [])), "stored", str(path), key,
                        entry["shape"])
        except Exception:  # noqa: BLE001 - any malformed entry refuses the file
            refuse(f"malformed entry {key!r}")
    return data


def read_results(path: Path, env: Optional[Mapping] = None) -> dict:
    """The file's contents ({} if it does not exist); TuningCacheError if it exists but is not one we wrote."""
    stamp = _stat(path)
    if stamp is None:
        return {}
    known = _files.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TuningCacheError(f"mla_inductor: the tuning file {path} is not usable (not JSON: {e}); it was not "
                               f"used. Delete it (tuning then measures again) or set ${AUTOTUNE_ENV}=0 to use "
                               f"the selection table only.") from e
    data = _validated(data, path, env)
    _files[path] = (stamp, data)
    return data


def write_results(path: Path, env: Mapping, results: Mapping[str, dict]) -> None:
    """Merge ``results`` into the file, atomically (a temporary file renamed over it: a reader sees the old
    file or the new one, never a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    current = read_results(path, env)
    merged = dict(current.get("results", {}))
    merged.update(results)
    data = {"format": FILE_FORMAT, "environment": dict(env), "results": dict(sorted(merged.items()))}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _files.pop(path, None)


def export_results(out: Path) -> int:
    """Write every environment's results under ``cache_dir()`` into one JSON file; returns how many results."""
    files = sorted((cache_dir() / "selection").glob("*.json"))
    entries = [read_results(p) for p in files]
    text = json.dumps({"format": FILE_FORMAT, "mla_inductor_tuning": entries}, indent=1, sort_keys=True)
    Path(out).write_text(text)
    return sum(len(e["results"]) for e in entries)


def import_results(source: Path) -> int:
    """Merge an ``export_results`` file into ``cache_dir()`` (each environment's results into its own file);
    returns how many results. TuningCacheError, naming the file, if it is not such a file."""
    source = Path(source)
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise TuningCacheError(f"mla_inductor: {source} is not an exported tuning file (not JSON: {e})") from e
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT or not isinstance(
            data.get("mla_inductor_tuning"), list):
        raise TuningCacheError(f"mla_inductor: {source} is not an exported tuning file (python -m "
                               f"mla_inductor.tune --export writes one)")
    entries = [_validated(e, source) for e in data["mla_inductor_tuning"]]
    for entry in entries:
        write_results(results_file(entry["environment"]), entry["environment"], entry["results"])
    return sum(len(e["results"]) for e in entries)


def tuning_key() -> str:
    """What measured selection contributes to the Inductor pass's cache key: the mode, the lengths timed and a
    digest of the stored results for this machine (so a changed result recompiles)."""
    mode = requested_mode()
    if mode == "0" or current_device_type() != "cuda":
        return f"mode={mode}"
    env = environment()
    path = results_file(env)
    stored = read_results(path, env).get("results", {})
    digest = hashlib.sha256(json.dumps(stored, sort_keys=True).encode()).hexdigest()[:16]
    return f"mode={mode} timing={timing_allowed('cuda', current_capability())} lengths={lengths()} results={digest}"


# ----------------------------------------------------------------------------- choosing

_timings = [0]  # timer calls made in this process (one per problem class timed)
_unmeasurable: set = set()  # (file, class key) where no candidate ran when timed
_timer: list[Optional[Timer]] = [None]  # the injected timer, if any
_lookups_only = threading.local()


def timing_count() -> int:
    """How many problem classes this process has timed."""
    return _timings[0]


@contextlib.contextmanager
def timing_with(timer: Optional[Timer]) -> Iterator[None]:
    """Time with ``timer`` inside the block (tests: fake timings)."""
    previous = _timer[0]
    _timer[0] = timer
    try:
        yield
    finally:
        _timer[0] = previous


@contextlib.contextmanager
def lookups_only() -> Iterator[None]:
    """Inside the block stored results are used but nothing is timed (``python -m mla_inductor.info``)."""
    previous = getattr(_lookups_only, "on", False)
    _lookups_only.on = True
    try:
        yield
    finally:
        _lookups_only.on = previous


def winner_of(times: Mapping[str, float], order: Sequence[str]) -> str:
    """The first backend of ``order`` whose time is within ``TIE`` of the fastest: ties go to the table."""
    fastest = min(times.values())
    return next(name for name in order if name in times and times[name] <= fastest * (1 + TIE))


def candidates_of(problem: DecodeProblem, capability, ranked: Sequence[tuple[str, Optional[str]]],
                  mode: str) -> list[str]:
    """The backends timed, in the table's order: the usable ones of the table's row (``ranked``, as
    ``selection.rank_backends`` gives it), and with mode "all" every other usable backend supporting the
    call. A last-resort backend (the reference) is never timed on a GPU."""
    names = [name for name, why in ranked if why is None]
    if mode == "all":
        available = backends.availability()
        for name in backends.registered_backends():
            if name not in names and available.get(name) is None:
                if backends.get_backend(name).supports(problem, capability) is None:
                    names.append(name)
    names = list(dict.fromkeys(names))
    return [n for n in names if not getattr(backends.get_backend(n), "last_resort", False)]


def _default_timer() -> Timer:
    from mla_inductor.timing import time_backends

    return time_backends


def measure(problem: DecodeProblem, shape: ProgramShape, candidates: Sequence[str], device,
            timer: Optional[Timer] = None) -> tuple[dict[str, float], dict[str, str]]:
    """Median microseconds per call of each candidate, and why each failing one failed."""
    timer = timer or _timer[0] or _default_timer()
    _timings[0] += 1
    started = time.perf_counter()
    rounds = timer(problem, shape, list(candidates), device)
    times, failed = {}, {}
    for name in candidates:
        result = rounds.get(name, "not timed")
        if isinstance(result, str):
            failed[name] = result
        else:
            times[name] = float(statistics.median(result))
    log.info("mla_inductor: timed %s for %s in %.2f s (us per call): %s", list(candidates), _shape_words(shape),
             time.perf_counter() - started, times)
    return times, failed


def _shape_words(shape: ProgramShape) -> str:
    return (f"{shape.kind}{', captured' if shape.captured and shape.kind == ONE_CALL_GRAPH else ''}, "
            f"{shape.calls} call{'s' if shape.calls != 1 else ''} per plan, B={shape.batch}, "
            f"{'varied lengths' if shape.varied else 'equal lengths'} up to {shape.seq_len}")


def measured_selection(problem: DecodeProblem, capability, context: Optional[CallContext],
                       ranked: Sequence[tuple[str, Optional[str]]]) -> Optional[Selection]:
    """The backend measurement chooses for this call (stored, or timed now where timing is allowed), or None to
    leave it to the table. Installed as ``selection``'s measurement hook."""
    if problem.device_type != "cuda" or user_preference() is not None:
        return None
    mode = requested_mode()
    if mode == "0":
        return None
    env = environment()
    path = results_file(env)
    key = class_key(problem, context, mode)
    entry = read_results(path, env).get("results", {}).get(key)
    source = "stored"
    if entry is None:
        if getattr(_lookups_only, "on", False) or not timing_allowed("cuda", capability) or _capturing():
            return None
        candidates = candidates_of(problem, capability, ranked, mode)
        if len(candidates) < 2:
            return None
        shape = program_shape(problem, context)
        if (path, key) in _unmeasurable:
            return None
        times, failed = measure(problem, shape, candidates, "cuda")  # the current CUDA device
        if not times:
            _unmeasurable.add((path, key))  # not timed again in this process (nor stored: it may be transient)
            log.warning("mla_inductor: no backend could be timed for %s (%s); the selection table decides", key,
                        "; ".join(f"{n}: {w}" for n, w in failed.items()))
            return None
        entry = {"winner": winner_of(times, candidates), "times": [[n, times[n]] for n in candidates if n in times],
                 "failed": sorted([n, w] for n, w in failed.items()), "shape": _shape_words(shape),
                 "order": list(candidates)}
        write_results(path, env, {key: entry})
        source = "measured"
    measurement = Measurement(tuple((n, float(us)) for n, us in entry["times"]),
                              tuple((n, w) for n, w in entry.get("failed", [])), source, str(path), key,
                              entry["shape"])
    winner = entry["winner"]
    usable = {name for name, why in ranked if why is None}
    if winner not in usable and not (mode == "all" and backends.availability().get(winner) is None
                                     and backends.get_backend(winner).supports(problem, capability) is None):
        return None  # stored for a backend this process cannot use: the table decides
    reasons = tuple(f"{name}: {why}" for name, why in ranked if why is not None and name != winner)
    fastest = min(us for _, us in measurement.times)
    slower = tuple(f"{name}: measured {us:.1f} us per call against {winner}'s "
                   f"{dict(measurement.times)[winner]:.1f} us" + (" (a tie: the table's order decides)"
                                                                   if us <= fastest * (1 + TIE) else "")
                   for name, us in measurement.times if name != winner)
    return Selection(winner, reasons + slower, measurement)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


consult_measurements(measured_selection)
