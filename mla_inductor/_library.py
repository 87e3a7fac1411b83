"""Defining the package's ops with the low-level Library API.

The dispatcher then calls the Python implementation directly. ``torch.library.custom_op`` would add Python
layers on every call (its autograd wrapper, the output alias checks), which cost several times the dispatch
itself: these ops run once per layer and step, eagerly or from compiled code.

The ops are inference-only: ``refuse_autograd`` gives an op an autograd formula whose backward raises (a
clear error where PyTorch's fallback would give a silent ``None`` gradient, in eager and compiled mode).
"""

from __future__ import annotations

import ast
import base64
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional

import torch

from mla_inductor._compat import (
    argument_errors_reach_the_user,
    eager_call_reaches_kernel,
    op_packet_class,
    schema_arguments,
)

_LIBRARIES: dict[str, torch.library.Library] = {}
# Ops whose implementation compiled code may call itself (``define_op(direct=True)``), and who wants to know.
_DIRECT_IMPLS: dict = {}  # OpOverload -> (impl, call_site)
_DIRECT_WATCHERS: list[Callable] = []


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable, tags: tuple = (), *, direct: bool = False,
              call_site: Optional[Callable] = None, eager_direct: bool = False,
              explain_refusal: Optional[Callable] = None):
    """Define the op ``qualname`` ("namespace::name") with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor x) -> Tensor"``), computed by ``impl`` and faked by ``fake``; its OpOverloadPacket.

    ``direct``: code compiled by Inductor may call ``impl`` itself, without the dispatcher (the pass arranges it,
    ``watch_direct_ops``): the dispatcher's part of a call (its argument parsing, the autograd fallback, handing
    the arguments back to Python) was more than half of a no-op op's host cost per compiled call (7.7 -> 3.2
    µs on CPU, ``benchmarks/bench_host_overhead.py --stub``), as much as a short decode kernel's host work. Only
    for ops whose implementation takes the schema's arguments (positionally, or a defaulted one by name) and needs
    nothing the dispatcher adds (compiled graphs reach them after autograd, under the device guard the compiled
    code sets).

    ``call_site(facts)``, for a direct op: a callable that computes ``impl``'s result for one call site of
    compiled code, given what the graph fixes there (``facts``: the schema's arguments, each tensor a
    ``StaticTensor``, each list a list, scalars as they are), or None to call ``impl``. What ``impl`` decides from
    those facts on every call (a lookup by shapes, a check of static sizes) is then decided once per site. Asked
    only where every size of the call is static (``lowering/_compat.call_without_dispatcher``).

    ``eager_direct``: an eager call ``torch.ops.<namespace>.<name>(...)`` (the op's packet; never its overloads,
    which compiled graphs and tracers call) goes to ``impl`` itself where the dispatcher would hand it the
    arguments as given (``EagerDirectPacket``): the round trip through the dispatcher is about a third of an
    eager decode call's host time (``benchmarks/bench_host_overhead.py``). Only for ops without mutable
    arguments (the dispatcher bumps their version counters) whose ``impl`` takes the schema's arguments
    positionally, a defaulted tail left out.

    ``explain_refusal(*args, **kwargs)``, for an ``eager_direct`` op: called with the arguments of a call of its
    packet that the dispatcher refused (a Python number where the schema has a tensor, say; eagerly and while
    torch.compile traces the call); it raises the op's own error where it knows what the valid form is, or
    returns and the dispatcher's error stands."""
    namespace, name = qualname.split("::")
    lib = _LIBRARIES.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    packet = getattr(getattr(torch.ops, namespace), name)
    if eager_direct:
        arguments = schema_arguments(packet.default)
        if any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
            raise ValueError(f"define_op({qualname!r}): eager_direct is for ops that write none of their arguments")
        kinds = tuple(_ARGUMENT_TYPES.get(str(a.type)) for a in arguments)
        if None in kinds:
            raise ValueError(f"define_op({qualname!r}): eager_direct takes Tensor, Tensor? and float arguments only")
        packet.__class__ = EagerDirectPacket
        packet._eager_impl = impl
        packet._eager_kinds = kinds
        packet._eager_least = sum(not a.has_default_value() for a in arguments)
        packet._eager_floats = tuple((i, a.name) for i, a in enumerate(arguments) if str(a.type) == "float")
        packet._eager_name = qualname.replace("::", ".")
        packet._explain_refusal = explain_refusal
    if direct:
        _DIRECT_IMPLS[packet.default] = (impl, call_site)
        for watch in _DIRECT_WATCHERS:
            watch(packet.default, impl, call_site)
    return packet


_reaches_kernel = eager_call_reaches_kernel()
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
# The Python types an argument of each schema type may have for the call to skip the dispatcher: exactly what the
# dispatcher would hand the kernel unchanged (anything else, a tensor subclass or an int for a float included,
# goes through the dispatcher, which converts it or raises its own error).
_ARGUMENT_TYPES = {"Tensor": (torch.Tensor,), "Optional[Tensor]": (torch.Tensor, type(None)),
                   "Tensor?": (torch.Tensor, type(None)), "float": (float,)}


class EagerDirectPacket(op_packet_class()):
    """The packet (``torch.ops.<namespace>.<name>``) of an op defined with ``eager_direct=True``: a call made where
    the dispatcher would go straight to the op's kernel (no dispatch or function mode, functorch transform or
    profiler; positional arguments within the schema's count, each of the exact type the dispatcher would hand
    over: a plain ``torch.Tensor``, None for an optional one, a float; no tensor requiring grad while grad mode is
    on) calls the kernel itself; any other call goes through the dispatcher as before, with its errors."""

    def __call__(self, /, *args, **kwargs):
        kinds = self._eager_kinds
        if not kwargs and self._eager_least <= len(args) <= len(kinds) and _reaches_kernel():
            grad = _grad_enabled()
            for a, kind in zip(args, kinds):
                if type(a) not in kind or (grad and type(a) is _Tensor and a.requires_grad):
                    break  # (a tensor needing grad: the op's autograd formula, which refuses a backward)
            else:
                return self._eager_impl(*args)
        self._refuse_tensor_floats(args, kwargs)
        try:
            return self._op(*args, **kwargs)
        except RuntimeError:
            if self._explain_refusal is None:
                raise
            try:
                with argument_errors_reach_the_user():  # the same error type eagerly and at compile time
                    self._explain_refusal(*args, **kwargs)
            except (TypeError, ValueError) as ours:
                raise ours from None  # it names the argument and its valid form: the dispatcher's adds nothing
            raise

    def _refuse_tensor_floats(self, args: tuple, kwargs: dict) -> None:
        # The dispatcher would take a one-element tensor for a float argument (reading it on the host), but
        # in a compiled graph it is a fake tensor it refuses: refused in both modes (Dynamo calls the packet
        # with the fake one), as the TypeError that passes through Dynamo.
        for i, name in self._eager_floats:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                with argument_errors_reach_the_user():
                    raise TypeError(f"{self._eager_name}: {name} must be a Python float, got a tensor: pass "
                                    f"float(t) (a compiled graph cannot hand a tensor to a float argument)")


def direct_ops_watched() -> bool:
    """Whether something (the Inductor pass) arranges direct calls for the ``direct=True`` ops: part of what
    decides the code Inductor generates, so of the pass's cache key."""
    return bool(_DIRECT_WATCHERS)


def watch_direct_ops(callback: Callable) -> None:
    """Call ``callback(op, impl, call_site)`` for every op defined with ``direct=True``: those defined so far, at
    once, and each later one as it is defined."""
    _DIRECT_WATCHERS.append(callback)
    for op, (impl, call_site) in list(_DIRECT_IMPLS.items()):
        callback(op, impl, call_site)


# ----------------------------------------------------------------------------- inference only

def _backward_refused(grads: list, inputs: list, what: str) -> list:
    raise RuntimeError(f"{what}: mla ops are inference-only, they have no backward; call them under "
                       f"torch.no_grad() or torch.inference_mode(), or detach the inputs")


def _backward_refused_fake(grads: list, inputs: list, what: str) -> list:
    return [torch.empty_like(x) for x in inputs]


# What the backward of every ``refuse_autograd`` op computes: an op, not a Python raise, so that a compiled
# graph's backward (traced when the forward is compiled, run only if the caller asks for gradients) raises
# when it runs, as the eager backward does; a forward that is never differentiated is unaffected. It takes the
# incoming gradients so that the partitioner cannot move it into the forward graph.
_BACKWARD_REFUSED = define_op("mla::backward_refused", "(Tensor[] grads, Tensor[] inputs, str what) -> Tensor[]",
                              _backward_refused, _backward_refused_fake)


def refuse_autograd(qualname: str, arg_names: tuple) -> None:
    """Give the op ``qualname`` an autograd formula whose backward raises RuntimeError("mla.<op> (<the
    arguments asking for a gradient>): mla ops are inference-only ..."). Calls without a tensor that requires
    grad (``torch.no_grad``, ``inference_mode``, plain tensors) never reach it: their eager calls and compiled
    graphs are unchanged."""
    op_name = "mla." + qualname.split("::")[1]

    def setup_context(ctx, inputs, output):
        wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        ctx.wanted = wanted
        ctx.arity = len(inputs)
        ctx.save_for_backward(*(inputs[i] for i in wanted))

    def backward(ctx, *grads):
        what = f"{op_name} (the gradient of {', '.join(arg_names[i] for i in ctx.wanted)})"
        refused = _BACKWARD_REFUSED.default([g for g in grads if g is not None], list(ctx.saved_tensors), what)
        result = [None] * ctx.arity
        for i, g in zip(ctx.wanted, refused):
            result[i] = g
        return tuple(result)

    torch.library.register_autograd(qualname, backward, setup_context=setup_context,
                                    lib=_LIBRARIES[qualname.split("::")[0]])


# ----------------------------------------------------------------------------- call sites

class StaticTensor(NamedTuple):
    """A tensor argument as a compiled call site knows it before the call: dtype, device and static shape (the
    graph's size checks hold every call to them). Has what shape logic reads of a tensor (``shape``, ``dtype``,
    ``device``, ``numel()``), so a backend's key functions take it as they take the tensor."""

    dtype: torch.dtype
    device: torch.device
    shape: tuple

    def numel(self) -> int:
        return math.prod(self.shape)


def _plain(fact) -> Any:
    if isinstance(fact, StaticTensor):
        return ("tensor", str(fact.dtype).removeprefix("torch."), str(fact.device), tuple(fact.shape))
    if isinstance(fact, torch.dtype):
        return ("dtype", str(fact).removeprefix("torch."))
    if isinstance(fact, (list, tuple)):
        return [_plain(f) for f in fact]
    return fact


def _fact(plain) -> Any:
    if isinstance(plain, tuple):
        return (StaticTensor(getattr(torch, plain[1]), torch.device(plain[2]), plain[3]) if plain[0] == "tensor"
                else getattr(torch, plain[1]))
    if isinstance(plain, list):
        return [_fact(p) for p in plain]
    return plain


def call_site_name(facts: tuple) -> str:
    """An identifier naming ``facts`` (what ``call_site_facts`` reads back): the generated code's name for the
    call site's callable. Compressed base32 (letters and digits): valid anywhere Inductor puts a kernel's name."""
    text = repr(tuple(_plain(f) for f in facts)).encode()
    return base64.b32encode(zlib.compress(text, 9)).decode().rstrip("=").lower()


def call_site_facts(name: str) -> tuple:
    """The facts ``call_site_name`` encoded in ``name``."""
    data = base64.b32decode(name.upper() + "=" * (-len(name) % 8))
    return tuple(_fact(p) for p in ast.literal_eval(zlib.decompress(data).decode()))
