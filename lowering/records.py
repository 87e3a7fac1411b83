"""What the pass chose, kept in the compiled graph itself, so it is known wherever the graph runs.

``decisions()`` lists every distinct backend choice; each is logged once on the ``mla_inductor.lowering``
logger. A graph Inductor serves from its FX graph (or AOTAutograd) cache was never seen by the pass in
this process, so the pass also writes its choices into the graph: one call of ``mla::compiled_with(key,
record)`` at the graph's start, whose ``record`` (JSON in base64: the decisions of the graph's calls and the
user preference they were made under) is a constant of the generated code and so cached with it.

At run time that op costs a dict lookup and one tuple compare. The first run of a record this process has
not made adds its decisions to ``decisions()`` and logs them; a run under another preference than the one
compiled in (``prefer_backends`` / ``MLA_INDUCTOR_BACKEND`` changed after compiling: Dynamo does not guard
on it) warns once per graph that the graph keeps the backends it chose.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from mla_inductor._library import define_op
from mla_inductor.contract import DecodeProblem
from mla_inductor.lowering._compat import keep_in_graph
from mla_inductor.selection import CallContext, user_preference
from mla_inductor.tuning import Measurement

log = logging.getLogger("mla_inductor.lowering")


@dataclass(frozen=True, repr=False)
class Decision:
    """One backend choice of the pass: for which call (``problem``, with symbolic sizes as selected), on which
    device, in which graph context; ``reasons`` says why each backend ahead of the winner was passed over
    (a refusal, a plan whose cost its graph cannot amortize, or a slower measured time), ``notes`` how symbolic
    sizes were decided, ``measurement`` the timings that chose it (``tuning.Measurement``: measured in this
    process or stored, microseconds per backend) or None where the selection table did (``source``).

    A symbolic batch is selected by size class: ``problem.batch`` is then the class's upper limit (8 for a
    traced B of 5), not the traced B; the printed form says so (``batch class B<=8 (traced B=5, ...)``)."""

    problem: DecodeProblem
    capability: Optional[tuple[int, int]]
    backend: str
    reasons: tuple[str, ...]
    context: Optional[CallContext] = None
    notes: tuple[str, ...] = ()
    measurement: Optional[Measurement] = None

    @property
    def source(self) -> str:
        """"table", or "measured" / "stored" (timed in this process / read from the tuning file)."""
        return "table" if self.measurement is None else self.measurement.source

    def __str__(self) -> str:
        p = self.problem
        where = p.device_type if self.capability is None else f"{p.device_type} sm{self.capability[0]}{self.capability[1]}"
        call = [f"{p.cache_format} cache", f"{str(p.q_dtype).replace('torch.', '')} query",
                f"H={_size(p.num_heads)}", f"L={_size(p.kv_lora_rank)}", f"R={_size(p.rope_dim)}",
                f"page {_size(p.page_size)}", f"sparse top-{_size(p.topk)}" if p.sparse else "dense",
                f"{_size(p.q_per_seq)} new token(s) per sequence", self._batch()]
        if p.fp8_query:
            call.append("fp8 query allowed")
        text = f"mla.paged_decode on {where} ({', '.join(call)})"
        if self.context is not None:
            text += f" in a graph with {self.context.calls_sharing_plan} call(s) sharing a plan" + (
                ", captured" if self.context.captured else "")
        text += f" -> {self.backend}"
        text += (" (the selection table)" if self.measurement is None
                 else f" (timings {self.measurement.describe()})")
        if self.reasons:
            text += f" (passed over: {'; '.join(self.reasons)})"
        others = [n for n in self.notes if not n.startswith("batch: ")]
        return text + (f" [{'; '.join(others)}]" if others else "")

    def __repr__(self) -> str:
        return f"Decision({self})"

    def _batch(self) -> str:
        """The batch as selected: a concrete B, or a symbolic batch's size class with the traced B."""
        note = next((n[len("batch: "):] for n in self.notes if n.startswith("batch: ")), None)
        B = self.problem.batch
        if note is None:
            return f"B={_size(B)}"
        traced = re.search(r"traced (\d+)", note)
        holds = re.search(r"class (.+)$", note)
        if traced is None:  # unbacked: no traced value to name
            return f"batch {note}"
        size_class = f"batch class B<={B}" if B is not None else "batch class above every size limit"
        return (f"{size_class} (traced B={traced.group(1)}, symbolic; this choice holds for "
                f"{holds.group(1) if holds else 'its class'})")


def _size(n: Optional[int]) -> str:
    return "symbolic" if n is None else str(n)


_decisions: dict[Decision, None] = {}  # ordered set
_graphs_being_lowered: list[dict[Decision, None]] = []
_watchers: list[list[Decision]] = []  # the lists of open ``decisions_made`` blocks


def decisions() -> list[Decision]:
    """Every distinct backend choice of the graphs compiled or loaded from Inductor's caches in this
    process, in order (a cached graph's once it has run)."""
    return list(_decisions)


@contextlib.contextmanager
def decisions_made() -> Iterator[list[Decision]]:
    """Every decision recorded while the block runs, in order, repeats included (``decisions()`` lists each
    distinct one once): what the graphs the pass rewrites in the block chose, even where an earlier graph
    chose the same (and the choices of a graph loaded from Inductor's caches whose record this process had not
    seen, on its first run)."""
    made: list[Decision] = []
    _watchers.append(made)
    try:
        yield made
    finally:
        _watchers.remove(made)


def _remember(decision: Decision, how: str) -> None:
    for made in _watchers:
        made.append(decision)
    if decision not in _decisions:
        _decisions[decision] = None
        log.info("%s%s", decision, how)


def log_decision(problem: DecodeProblem, capability, selection, context: Optional[CallContext] = None,
                 notes=()) -> Decision:
    """Record the pass's choice for one call (kept for the graph being lowered, if any)."""
    decision = Decision(problem, capability, selection.backend, selection.reasons, context, tuple(notes),
                        selection.measurement)
    _remember(decision, "")
    if _graphs_being_lowered:
        _graphs_being_lowered[-1][decision] = None
    return decision


@contextlib.contextmanager
def decisions_of_graph() -> Iterator[dict[Decision, None]]:
    """Collects the decisions ``log_decision`` records while one graph is rewritten."""
    made: dict[Decision, None] = {}
    _graphs_being_lowered.append(made)
    try:
        yield made
    finally:
        _graphs_being_lowered.pop()


# ----------------------------------------------------------------------------- the record in the graph

@dataclass
class _Record:
    preference: Optional[tuple[str, ...]]
    backends: tuple[str, ...]
    warned: bool = False


_records: dict[str, _Record] = {}  # key -> what a compiled graph chose, for the graphs seen in this process


def write_record(graph: torch.fx.Graph, made: dict[Decision, None]) -> None:
    """Put ``mla::compiled_with(key, record)`` at the start of ``graph`` (if the pass chose anything)."""
    if not made:
        return
    preference = user_preference()
    text = json.dumps({"preference": preference, "decisions": [_as_json(d) for d in made]}, sort_keys=True)
    # Base64: the record is a string constant of the generated code, which the C++ wrapper (cpp_wrapper,
    # AOTInductor) writes into a C++ string literal without escaping JSON's quotes.
    record = base64.urlsafe_b64encode(text.encode()).decode("ascii")
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    _records[key] = _Record(preference, tuple(dict.fromkeys(d.backend for d in made)))
    # After the last input: with freezing, constants (get_attr) may come before some placeholders.
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1:]
    with graph.inserting_after(last_input[0]) if last_input else graph.inserting_before(next(iter(graph.nodes))):
        node = graph.call_function(COMPILED_WITH, (_anchor(graph, next(iter(made))), key, record))
    node.meta["val"] = None


def _anchor(graph: torch.fx.Graph, decision: Decision) -> Optional[torch.fx.Node]:
    """An input tensor on the calls' device, given to the op only to place it there: Inductor keeps a
    GPU op inside the graph's CUDA graphs (where it runs when they are recorded, not at each replay),
    whereas an op on no device would be split out of them and run at every step."""
    for node in graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and value.device.type == decision.problem.device_type:
            return node
    return None


def _compiled_with(anchor: Optional[torch.Tensor], key: str, record: str) -> None:
    known = _records.get(key)
    if known is None:
        known = _records[key] = _load(record)
    if not known.warned and user_preference() != known.preference:
        known.warned = True
        message = (f"mla_inductor: a compiled graph chose its MLA backends {list(known.backends)} under the "
                   f"backend preference {known.preference}; the preference is now {user_preference()} and "
                   f"that graph keeps what it chose (Dynamo does not guard on the preference). "
                   f"torch.compiler.reset() or a new torch.compile compiles under the new one.")
        log.warning(message)
        warnings.warn(message, stacklevel=2)


def _load(record: str) -> _Record:
    """A record this process did not write: a graph from Inductor's cache. Its decisions join
    ``decisions()`` and are logged."""
    data = json.loads(base64.urlsafe_b64decode(record))
    made = [_from_json(d) for d in data["decisions"]]
    for decision in made:
        _remember(decision, " (a compiled graph from Inductor's cache)")
    preference = tuple(data["preference"]) if data["preference"] is not None else None
    return _Record(preference, tuple(dict.fromkeys(d.backend for d in made)))


def _as_json(decision: Decision) -> dict:
    problem = {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v)
               for k, v in dataclasses.asdict(decision.problem).items()}
    context = dataclasses.asdict(decision.context) if decision.context is not None else None
    return {"problem": problem, "capability": decision.capability, "backend": decision.backend,
            "reasons": list(decision.reasons), "context": context, "notes": list(decision.notes),
            "measurement": decision.measurement.as_json() if decision.measurement is not None else None}


def _from_json(data: dict) -> Decision:
    problem = dict(data["problem"], q_dtype=getattr(torch, data["problem"]["q_dtype"]))
    capability = tuple(data["capability"]) if data["capability"] is not None else None
    context = CallContext(**data["context"]) if data.get("context") is not None else None
    measurement = Measurement.from_json(data["measurement"]) if data.get("measurement") is not None else None
    return Decision(DecodeProblem(**problem), capability, data["backend"], tuple(data["reasons"]), context,
                    tuple(data.get("notes", ())), measurement)


# Defined with the low-level Library API: no custom_op Python layers on a call made every step; and called by
# the generated code without the dispatcher (``direct``), whose part of a call is most of this op's cost: a
# graph of one decode call (an MTP draft layer, a layer compiled alone) runs it once per call.
COMPILED_WITH = define_op("mla::compiled_with", "(Tensor? anchor, str key, str record) -> ()", _compiled_with,
                          lambda anchor, key, record: None, direct=True).default
keep_in_graph(COMPILED_WITH)  # it returns nothing: without this, dead-code elimination drops it
