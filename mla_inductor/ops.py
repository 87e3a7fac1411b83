"""The ops ``torch.ops.mla.paged_decode``, ``paged_decode_with_lse`` and ``cache_append``: schema, fake
impl and docstring side by side, and the eager implementation (contract -> selection -> backend).

Importing this module registers the ops (``import mla_inductor`` does). Shapes and semantics:
``mla_inductor.contract`` and docs/contract.md.

Eager calls already run on the selected backend: the implementation validates the arguments, asks
``selection`` which backend runs the call, and calls that backend. Correctness never depends on the
compiler; under ``torch.compile`` the Inductor pass replaces the calls before they run.

The decode ops take the contract's eight arguments and an optional ``q_scale`` ([1] fp32): the static
per-tensor scale of the query for backends that compute with q in e4m3. It does not change the result's
definition (the reference computes with q as given); see ``contract`` for when to pass one.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, NamedTuple, Optional

import torch

from mla_inductor._compat import (argument_errors_reach_the_user, current_compile, current_cuda_device,
                                  tensor_properties_check)
from mla_inductor._library import define_op, refuse_autograd
from mla_inductor._memo import Memo
from mla_inductor.contract import (
    OP_ARG_NAMES,
    OP_ARGS_SCHEMA,
    DecodeProblem,
    assert_append_values_on_device,
    assert_decode_values_on_device,
    attends_nothing,
    being_captured,
    call_signature,
    check_append_args,
    check_append_values,
    check_decode_args,
    check_decode_values,
    checks_on_device,
    empty_decode_outputs,
    explain_refused_decode_args,
    fail,
    nothing_attended,
    wants_value_checks,
)
from mla_inductor.reference import autocast_off
from mla_inductor.selection import backend_for_append, backend_for_eager, selection_state

Tensor = torch.Tensor
_any_autocast = torch._C._is_any_autocast_enabled


# ----------------------------------------------------------------------------- decode

# Eager calls decide once per distinct call signature (shapes, strides, dtypes, devices, softmax_scale: everything
# the argument checks read), selection state (user preference, FP8-query opt-in, registered backends) and
# whether the call is being captured in a CUDA graph what can be decided once: the checks that need no data, the
# DecodeProblem, whether the call attends anything, and the backend's bound run function. A call then costs a
# key, a dict lookup and the run, or, like the op's last call, a check of its tensors and the run (_Repeat); the
# checks that read data (CPU always, GPUs in debug mode) still run on every call. A call made while the user
# captures a CUDA graph is selected as a captured one-call graph's would be: replays repeat it without its host
# work, so it needs a backend that plans on the device or needs no plan.
_EAGER_CALLS: Memo = Memo()
_ARITY = len(OP_ARG_NAMES)


class _EagerCall:
    __slots__ = ("problem", "attends_nothing", "run", "cuda_index", "repeat")

    def __init__(self, problem: DecodeProblem, attends_nothing: bool, run, cuda_index: int):
        self.problem = problem
        self.attends_nothing = attends_nothing
        self.run = run  # the contract's nine arguments -> (out, lse), or out alone for mla.paged_decode
        self.cuda_index = cuda_index  # the tensors' CUDA device, -1 elsewhere
        self.repeat: Optional[_Repeat] = None  # made once per signature, for the calls after one of its calls


def _new_eager_call(op: str, args: tuple, with_lse: bool, captured: bool) -> _EagerCall:
    """Decide what a new signature decides (bad arguments raise here, on every call: nothing is stored)."""
    problem = check_decode_args(*args, op=op)
    q_nope, kv_cache, block_table, sparse_indices = args[0], args[2], args[3], args[7]
    nothing = attends_nothing(q_nope, kv_cache, block_table, sparse_indices)
    # The run is bound to the capture state too (part of the key): it need not ask the driver again.
    backend = None if nothing else backend_for_eager(problem, q_nope.device, captured)
    run = None if nothing else backend.eager_decode(problem, args, with_lse, captured=captured)
    return _EagerCall(problem, nothing, run, q_nope.get_device() if q_nope.is_cuda else -1)


class _Repeat(NamedTuple):
    """The last eager call of an op, for the next call with the same signature (consecutive calls nearly always
    have one: the layers of a step): its selection state, capture state, softmax_scale, which optional tensors
    were None, a check of its tensors' properties (``_compat.tensor_properties_check``: what ``call_signature``
    holds of them, without building and hashing it) and the ``_EagerCall`` the signature decided."""

    memo: dict  # the _EAGER_CALLS it was decided in (a fresh memo starts over)
    state: tuple
    captured: bool
    scale: object
    nones: tuple
    tensors: Callable  # args -> the tensors checked
    same_tensors: Callable[..., bool]
    call: _EagerCall

    def repeats(self, args: tuple, state: tuple, captured: bool) -> bool:
        scale = args[5]
        try:
            return (self.memo is _EAGER_CALLS and state == self.state and captured == self.captured
                    and type(scale) is type(self.scale) and scale == self.scale
                    and (args[6] is None, args[7] is None, args[8] is None) == self.nones
                    and self.same_tensors(*self.tensors(args)))
        except TypeError:  # not a tensor where one was: the full path names the argument
            return False


_REPEATS: dict[str, _Repeat] = {}


def _repeat(args: tuple, state: tuple, captured: bool, call: _EagerCall) -> Optional[_Repeat]:
    tensors = operator.itemgetter(*(i for i, a in enumerate(args) if i != 5 and a is not None))
    same_tensors = tensor_properties_check(tensors(args))
    if same_tensors is None:
        return None
    return _Repeat(_EAGER_CALLS, state, captured, args[5], (args[6] is None, args[7] is None, args[8] is None),
                   tensors, same_tensors, call)


def _decode(op: str, with_lse: bool, args: tuple):
    """An eager decode call: ``args`` as the dispatcher hands them (a defaulted tail may be left out)."""
    if len(args) < _ARITY:
        args = (*args, *((None,) * (_ARITY - len(args))))
    q_nope = args[0]
    try:
        captured = being_captured(q_nope)
        state = selection_state()
        last = _REPEATS.get(op)
        if last is not None and last.repeats(args, state, captured):
            call = last.call
        else:
            call = None
            key = (op, state, call_signature(*args), captured)
    except AttributeError:  # not through the dispatcher: the checks name the argument of the wrong type
        check_decode_args(*args, op=op)
        raise
    if call is None:
        call = _EAGER_CALLS.get(key)
        if call is None:
            call = _EAGER_CALLS.put(key, _new_eager_call(op, args, with_lse, captured))
            call.repeat = _repeat(args, state, captured, call)
        if call.repeat is not None:
            _REPEATS[op] = call.repeat
    if wants_value_checks(q_nope):
        q_nope, _, kv_cache, block_table, seq_lens, _, kv_scale, sparse_indices, q_scale = args
        check = assert_decode_values_on_device if captured else check_decode_values
        check(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, op=op, q_scale=q_scale)
    if call.attends_nothing:
        out, lse = nothing_attended(q_nope)
        return (out, lse) if with_lse else out
    if _any_autocast():  # the caller's autocast region does not change the contract's precision
        with autocast_off(q_nope):
            return _run(call, args)
    return _run(call, args)


def _run(call: _EagerCall, args: tuple):
    # softmax_scale reaches us as a float (the schema's type; the key holds it), so the run takes args as given.
    if call.cuda_index >= 0 and current_cuda_device() != call.cuda_index:
        # Kernels launch on the current device (Triton's, FlashMLA's streams): make it the tensors' one, as
        # the compiled code's device guard does.
        with torch.cuda.device(call.cuda_index):
            return call.run(*args)
    return call.run(*args)


def _paged_decode_with_lse(*args) -> tuple[Tensor, Tensor]:
    """MLA paged decode returning ``(out [T, H, L] in q's dtype, lse [T, H] fp32)``; see ``contract``."""
    return _decode("paged_decode_with_lse", True, args)


# The softmax_scale values each compiled function (Dynamo's frame id) was compiled for, per op and tensor
# signature: {key: {(frame_compile_id, its tracing context): {scale, ...}}}.
_COMPILED_SCALES: dict[tuple, dict[tuple, set]] = {}
# How many values of softmax_scale one compiled function may be compiled for (a few models of one class, the
# same shapes and different scales, share their forward's code), well below Dynamo's recompile limit.
SCALES_PER_COMPILED_FUNCTION = 3


def _few_scales_per_compiled_function(args: tuple, op: str) -> None:
    """Refuse a recompile of a function for one ``softmax_scale`` value too many with the same tensors.

    Dynamo specializes a float argument on its value: a value that changes between calls recompiles the whole
    function every call until Dynamo's recompile limit fails with an error that names nothing of ours. The
    first value past ``SCALES_PER_COMPILED_FUNCTION`` raises instead, saying what to do; the values compiled
    before keep running."""
    compiling = current_compile()
    scale = args[5]
    if compiling is None or type(scale) is not float:
        return
    frame_id, frame_compile_id, tracing_id = compiling
    key = (frame_id, op, *((str(a.shape), a.dtype, a.device) for a in args if isinstance(a, Tensor)))
    compiles = _COMPILED_SCALES.setdefault(key, {})
    this_compile = (frame_compile_id, tracing_id)
    if frame_compile_id == 0 and this_compile not in compiles:
        compiles.clear()  # a frame's first compile: what its id held before a torch._dynamo.reset() is gone
    earlier = set().union(*(scales for (c, _), scales in compiles.items() if c < frame_compile_id))
    if len(earlier) >= SCALES_PER_COMPILED_FUNCTION and scale not in earlier:
        fail(op, ValueError, f"softmax_scale changes between calls of one compiled function (compiled for "
             f"{', '.join(map(str, sorted(earlier)))}; now {scale}): torch.compile specializes a float argument on "
             f"its value and compiles the function again for each value; keep softmax_scale constant (a model "
             f"constant such as head_dim ** -0.5), or compile one function per value")
    compiles.setdefault(this_compile, set()).add(scale)


def _paged_decode_with_lse_fake(*args):
    with argument_errors_reach_the_user():
        check_decode_args(*args, op="paged_decode_with_lse")
        _few_scales_per_compiled_function(args, "paged_decode_with_lse")
    return empty_decode_outputs(args[0])


# The ops are defined with the low-level Library API (``_library``): an eager call goes from the dispatcher
# straight to the implementation, or (a plain eager call of the packet, ``eager_direct``) to it without the
# dispatcher.
paged_decode_with_lse = define_op("mla::paged_decode_with_lse", f"({OP_ARGS_SCHEMA}) -> (Tensor, Tensor)",
                                  _paged_decode_with_lse, _paged_decode_with_lse_fake, eager_direct=True,
                                  explain_refusal=functools.partial(explain_refused_decode_args,
                                                                    op="paged_decode_with_lse"))


def _paged_decode(*args) -> Tensor:
    """MLA paged decode: attention output ``[T, H, L]`` in q's dtype; see ``contract``."""
    return _decode("paged_decode", False, args)


def _paged_decode_fake(*args):
    with argument_errors_reach_the_user():
        check_decode_args(*args)
        _few_scales_per_compiled_function(args, "paged_decode")
    return empty_decode_outputs(args[0])[0]


paged_decode = define_op("mla::paged_decode", f"({OP_ARGS_SCHEMA}) -> Tensor", _paged_decode, _paged_decode_fake,
                         eager_direct=True, explain_refusal=explain_refused_decode_args)

for _qualname in ("mla::paged_decode", "mla::paged_decode_with_lse"):
    refuse_autograd(_qualname, OP_ARG_NAMES)
    # A call whose output is unused still checks its arguments' values, in compiled graphs as in eager calls:
    # dead-code elimination (Dynamo's, AOTAutograd's) must keep it for the pass, which puts the value checks
    # before it (``torch.fx.node.has_side_effect``; once rewritten, an unused kernel call may go).
    torch.fx.node.has_side_effect(getattr(torch.ops.mla, _qualname.split("::")[1]).default)


# ----------------------------------------------------------------------------- cache_append

def _cache_append(kv_cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_scale: Tensor) -> None:
    """Write token i's ``[kv_c[i] | k_pe[i]]`` into flat slot ``slot_mapping[i]`` of ``kv_cache`` in place.

    kv_cache [P, page_size, L+R] (or 656-byte fp8_ds_mla rows), kv_c [N, L], k_pe [N, R], slot_mapping [N]
    int32/int64 with -1 = skip, kv_scale [1] fp32. fp8 caches are quantized (saturating at ±448);
    fp8_ds_mla computes one scale per 128 latent values. The writer is the first backend of
    ``selection.APPEND_ORDER`` that can write on the cache's device.
    """
    check_append_args(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
    if wants_value_checks(slot_mapping):
        check = assert_append_values_on_device if checks_on_device(slot_mapping) else check_append_values
        check(kv_cache, slot_mapping, kv_scale)
    writer = backend_for_append(kv_cache.device)
    if kv_cache.is_cuda and current_cuda_device() != kv_cache.get_device():
        with torch.cuda.device(kv_cache.device):
            return writer.append(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
    writer.append(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)


def _cache_append_fake(kv_cache, kv_c, k_pe, slot_mapping, kv_scale):
    with argument_errors_reach_the_user():
        check_append_args(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)


cache_append = define_op("mla::cache_append", "(Tensor(a!) kv_cache, Tensor kv_c, Tensor k_pe, Tensor slot_mapping, "
                         "Tensor kv_scale) -> ()", _cache_append, _cache_append_fake, direct=True)


__all__ = ["cache_append", "paged_decode", "paged_decode_with_lse"]
