"""Every case of the hostile-input table (tests/hostile_cases.py), eager and compiled on CPU, and
docs/reliability.md's table generated from it.

    python tests/test_hostile.py --markdown     # prints the table docs/reliability.md holds

Compiled runs share graphs: cases whose arguments have the same signature (shapes, strides, dtypes,
constants) run through one compiled function, compiled once (Inductor's CPU compile is the cost).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

import mla_inductor  # noqa: F401 - registers the ops
from hostile_cases import ARG_NAMES, CASES, SCENARIOS, Raises, Returns, base_args
from mla_inductor.cache import FP8_E4M3_MAX
from mla_inductor.contract import assert_append_values_on_device, assert_decode_values_on_device
from mla_inductor.testing import TOLERANCE, relative_error
from naive import naive_decode, rows_as_float64

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- generated: python tests/test_hostile.py --markdown -->\n", "<!-- end generated -->"


def call_args(case) -> tuple:
    a = base_args(case.base)
    case.edit(a)
    return tuple(a[n] for n in ARG_NAMES[case.op])


def run_op(op: str, *args):
    return getattr(torch.ops.mla, op)(*args)


# ----------------------------------------------------------------------------- compiled, grouped

_COMPILED: dict[tuple, object] = {}


def _signature(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def compiled(op: str, args: tuple):
    """A compiled function for calls of ``op`` with arguments of this signature: one per signature, each
    with a code object of its own, so Dynamo compiles each once and never recompiles it."""
    key = (op, *map(_signature, args))
    if key not in _COMPILED:
        def call(*a):
            return run_op(op, *a)
        call.__code__ = call.__code__.replace(co_name=f"hostile_{len(_COMPILED)}")
        _COMPILED[key] = torch.compile(call, fullgraph=True)
    return _COMPILED[key]


def run_compiled(op: str, args: tuple):
    with torch._dynamo.config.patch(error_on_recompile=True):
        return compiled(op, args)(*args)


# ----------------------------------------------------------------------------- checks

def expect_raises(case, run, compiled_mode: bool):
    expect = case.expect
    prefix = "" if expect.type is RuntimeError else rf"^mla\.{case.op}: .*"
    with pytest.raises(expect.type, match=prefix + re.escape(expect.text)) as info:
        run()
    if compiled_mode and expect.type is not RuntimeError:
        # Raised while Dynamo traced the fake impl (the class it passes through) or by the graph's checks.
        from torch._dynamo.exc import Unsupported

        assert isinstance(info.value, Unsupported) == (expect.at == "compile"), (expect.at, type(info.value))


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> float:
    """``relative_error`` where NaN must sit exactly where the oracle has NaN (a NaN in an attended row reaches
    the rows that attend it, and no other); inf where NaN positions differ."""
    nan = expected.isnan()
    if not torch.equal(actual.isnan(), nan):
        return float("inf")
    return relative_error(actual[~nan], expected[~nan])


def check_decode_result(case, args, result):
    out, lse = result if case.op == "paged_decode_with_lse" else (result, None)
    q_nope = args[0]
    T, H, L = q_nope.shape
    assert out.shape == (T, H, L) and out.dtype == q_nope.dtype and out.is_contiguous()
    if lse is not None:
        assert lse.shape == (T, H) and lse.dtype == torch.float32 and lse.is_contiguous()
    if case.expect.check == "empty":
        assert T == 0
        return
    want_out, want_lse = naive_decode(*args[:8])
    tol = TOLERANCE[q_nope.dtype]
    assert close(out, want_out.to(out.dtype), tol) < tol, close(out, want_out.to(out.dtype), tol)
    if lse is not None:
        assert close(lse, want_lse.float(), tol) < tol, close(lse, want_lse.float(), tol)


def naive_merge(outs: list, lses: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge as docs/contract.md defines it, one (row, head) at a time in float64: NaN lse = -inf = an
    empty part (its output unread); parts of lse +inf share the whole weight equally; else ``exp(lse_i - lse)``."""
    T, H, L = outs[0].shape
    out, lse = torch.zeros(T, H, L, dtype=torch.float64), torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            parts = [(float(x[t, h]), o[t, h].double()) for x, o in zip(lses, outs)]
            parts = [(x, o) for x, o in parts if x == x and x != float("-inf")]
            if not parts:
                continue
            top = max(x for x, _ in parts)
            if top == float("inf"):
                chosen = [o for x, o in parts if x == top]
                out[t, h], lse[t, h] = sum(chosen) / len(chosen), top
                continue
            weights = [torch.exp(torch.tensor(x - top, dtype=torch.float64)) for x, _ in parts]
            total = sum(weights)
            out[t, h] = sum(w * o for w, (_, o) in zip(weights, parts)) / total
            lse[t, h] = top + torch.log(total)
    return out, lse


def check_merged(case, args, result):
    out, lse = result
    outs, lses = (args[0].unbind(0), args[1].unbind(0)) if case.op == "merge_attn_states_n" else (args[0::2],
                                                                                                 args[1::2])
    T, H, L = outs[0].shape
    assert out.shape == (T, H, L) and out.dtype == outs[0].dtype and out.is_contiguous()
    assert lse.shape == (T, H) and lse.dtype == torch.float32 and lse.is_contiguous()
    want_out, want_lse = naive_merge(outs, lses)
    tol = TOLERANCE[out.dtype]
    assert close(out, want_out.to(out.dtype), tol) < tol, close(out, want_out.to(out.dtype), tol)
    assert close(lse, want_lse.float(), 1e-6) < 1e-6, close(lse, want_lse.float(), 1e-6)


def check_appended_fp8_ds_mla(args, before: torch.Tensor):
    """Rows not listed keep their bytes; each written row decodes to its values: every 128-value tile in e4m3
    to within its step, scaled by the amax of the tile's finite values, ±inf saturated at ±that amax, NaN as
    NaN; the rope in bf16."""
    kv_cache, kv_c, k_pe, slot_mapping, _ = args
    flat, old = kv_cache.view(-1, kv_cache.shape[-1]), before.view(-1, before.shape[-1])
    listed = {int(s) for s in slot_mapping.tolist() if s >= 0}
    for slot in range(flat.shape[0]):
        if slot not in listed:
            assert torch.equal(flat[slot], old[slot]), f"slot {slot} was not listed but changed"
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        got = rows_as_float64(flat[slot:slot + 1], None)[0]
        latent = kv_c[i].double().view(-1, 128)
        amax = torch.where(torch.isfinite(latent), latent.abs(), 0.0).amax(-1, keepdim=True)
        scale = (amax / 448).clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero tile stays zero
        top = 448 * scale
        want = torch.cat([torch.maximum(torch.minimum(latent, top), -top).flatten(), k_pe[i].double()])
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), "NaN where the value was NaN, and nowhere else"
        step = torch.cat([(scale * 2**-6).expand(-1, 128).flatten(), torch.zeros(k_pe.shape[1])])
        bound = torch.cat([torch.full((512,), 2.0**-4), torch.full((k_pe.shape[1],), 2.0**-8)]) * want.abs() + step
        assert bool(((got - want).abs()[~nan] <= bound[~nan]).all()), "a stored value is off by more than e4m3's step"


def check_appended(case, args, before: torch.Tensor):
    kv_cache, kv_c, k_pe, slot_mapping, kv_scale = args
    if kv_cache.dtype == torch.uint8:
        return check_appended_fp8_ds_mla(args, before)
    want = before.clone()
    flat = want.view(-1, want.shape[-1])
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            row = torch.cat([kv_c[i].float(), k_pe[i].float()])
            if kv_cache.dtype == torch.float8_e4m3fn:
                row = (row / float(kv_scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            flat[slot] = row.to(kv_cache.dtype)
    assert torch.equal(kv_cache.view(torch.uint8), want.view(torch.uint8))


def run_case(case, compiled_mode: bool):
    args = call_args(case)
    run = (lambda: run_compiled(case.op, args)) if compiled_mode else (lambda: run_op(case.op, *args))
    if isinstance(case.expect, Raises):
        expect_raises(case, run, compiled_mode)
    elif case.op == "cache_append":
        before = args[0].clone()
        run()
        check_appended(case, args, before)
    elif case.op.startswith("merge"):
        check_merged(case, args, run())
    else:
        check_decode_result(case, args, run())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_eager(case):
    run_case(case, compiled_mode=False)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compiled(case):
    run_case(case, compiled_mode=True)


def _device_checks(case, args):
    if case.op == "cache_append":
        kv_cache, _, _, slot_mapping, kv_scale = args
        assert_append_values_on_device(kv_cache, slot_mapping, kv_scale)
    else:
        q_nope, _, kv_cache, block_table, seq_lens, _, kv_scale, sparse_indices, q_scale = args
        assert_decode_values_on_device(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices,
                                       op=case.op, q_scale=q_scale)


# (The merge ops have no value checks: every merge argument error is a shape, dtype or device error.)
VALUE_CASES = [c for c in CASES if isinstance(c.expect, Raises) and c.expect.at == "run" and c.gpu_form]
VALID_CASES = [c for c in CASES if isinstance(c.expect, Returns) and not c.op.startswith("merge")]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c.name for c in VALUE_CASES])
def test_device_asserts_refuse_what_the_host_checks_refuse(case):
    """The GPU form of the value checks (device-side asserts: compiled graphs in debug mode, eager calls
    during CUDA-graph capture), run on CPU, where torch._assert_async raises at once."""
    text = case.expect.text.split(", got")[0]
    with pytest.raises(RuntimeError, match=re.escape(f"mla.{case.op}: {text}")):
        _device_checks(case, call_args(case))


@pytest.mark.parametrize("case", VALID_CASES, ids=[c.name for c in VALID_CASES])
def test_device_asserts_pass_valid_calls(case):
    _device_checks(case, call_args(case))


# ----------------------------------------------------------------------------- stateful scenarios

SCENARIO_RUNS = [(s, compiled) for s in SCENARIOS for compiled in ((False, True) if s.compiled else (False,))]


@pytest.mark.parametrize("scenario, compiled_mode", SCENARIO_RUNS,
                         ids=[f"{s.name} [{'compiled' if c else 'eager'}]" for s, c in SCENARIO_RUNS])
def test_scenario(scenario, compiled_mode):
    if isinstance(scenario.expect, Raises):
        with pytest.raises(scenario.expect.type, match=re.escape(scenario.expect.text)):
            scenario.run(compiled_mode)
    else:
        scenario.run(compiled_mode)


# ----------------------------------------------------------------------------- the doc

def _result(case, compiled_mode: bool) -> str:
    expect = case.expect
    if isinstance(expect, Returns):
        return expect.what
    message = expect.text.replace("|", "\\|")
    if expect.type is RuntimeError:  # refused by PyTorch's dispatcher before any code of ours
        text = f"RuntimeError from PyTorch's dispatcher: {message}"
    else:
        text = f"{expect.type.__name__}: {message}"
    if not compiled_mode:
        return text
    return "the same, at compile time" if expect.at == "compile" else "the same, when the graph runs"


def _scenario_result(scenario, compiled_mode: bool) -> str:
    if compiled_mode and not scenario.compiled:
        return "one mode: a host-side method, nothing to compile"
    if compiled_mode:
        return scenario.compiled_result or "the same, from the compiled step"
    expect = scenario.expect
    if isinstance(expect, Returns):
        return expect.what
    return f"{expect.type.__name__}: {expect.text}".replace("|", "\\|")


def _row(*cells, width: int = 195) -> str:
    """One table row within ``width`` characters: the longest cells are cut first (the doc's line limit)."""
    cells = [str(c) for c in cells]
    while len("| " + " | ".join(cells) + " |") > width:
        i = max(range(len(cells)), key=lambda k: len(cells[k]))
        cells[i] = cells[i][:len(cells[i]) - 2].rstrip().removesuffix("…") + "…"
    return "| " + " | ".join(cells) + " |"


def hostile_table_markdown() -> str:
    lines = [f"{len(CASES)} calls, each run eagerly and under `torch.compile(fullgraph=True)` on CPU by "
             f"`tests/test_hostile.py`, then {len(SCENARIOS)} stateful",
             "scenarios (a cache's methods, `generate()` with a `PagedMLACache`), eager and with the decode steps "
             "compiled where they have a compiled form.",
             "Long messages are cut (…); the test checks each whole.",
             "", "| # | op | call | eager | compiled |", "|---|---|---|---|---|"]
    for i, case in enumerate(CASES, 1):
        op = {"paged_decode": "decode", "cache_append": "append", "merge_attn_states": "merge"}[
            case.op.removesuffix("_with_lse").removesuffix("_n")]
        name = case.name.replace("cache_append: ", "")
        lines.append(_row(i, op, name, _result(case, False), _result(case, True)))
    for i, scenario in enumerate(SCENARIOS, len(CASES) + 1):
        lines.append(_row(i, "scenario", scenario.name, _scenario_result(scenario, False),
                          _scenario_result(scenario, True)))
    return "\n".join(lines) + "\n"


def test_docs_reliability_md_lists_every_case():
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    assert doc[start:end] == hostile_table_markdown(), "docs/reliability.md is stale: regenerate its table"


def test_the_table_is_long_and_every_name_is_unique():
    assert len(CASES) >= 200 and len({c.name for c in CASES}) == len(CASES)
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


if __name__ == "__main__" and "--markdown" in sys.argv:
    print(hostile_table_markdown(), end="")
