"""Plain eager calls of the decode ops' packets skip the dispatcher (``_library.EagerDirectPacket``); every other
call (keyword arguments, a tensor subclass, an argument of another type, a dispatch or function mode, a functorch
transform, the profiler) goes through it as before, with the same results and errors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import mla_inductor
from mla_inductor import _library
from mla_inductor.testing import make_decode_inputs, relative_error

OPS = [torch.ops.mla.paged_decode, torch.ops.mla.paged_decode_with_lse]


def _out(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.fixture
def counted(monkeypatch):
    """Count the calls that reach the dispatcher (the packet's C++ op) for each decode op."""
    calls = {op.__name__: 0 for op in OPS}  # (by name: a packet hashes its C++ op, which this replaces)
    for op in OPS:
        through = op._op

        def counting(*args, _through=through, _name=op.__name__, **kwargs):
            calls[_name] += 1
            return _through(*args, **kwargs)

        monkeypatch.setattr(op, "_op", counting)
    return calls


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_plain_eager_calls_skip_the_dispatcher_and_compute_the_same(op, counted):
    x = make_decode_inputs([5, 70], num_heads=4, seed=2)
    args = x.args()
    want = _out(mla_inductor.paged_decode_reference(*args))
    assert isinstance(op, _library.EagerDirectPacket)
    direct = _out(op(*args))
    assert counted[op.__name__] == 0 and relative_error(direct, want) < 1e-2
    # A defaulted tail left out (sparse_indices, q_scale): still direct.
    assert relative_error(_out(op(*args[:7])), want) < 1e-2 and counted[op.__name__] == 0
    # Through the dispatcher: keyword arguments, or one of them.
    names = ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "softmax_scale", "kv_scale")
    through = [op(**dict(zip(names, args[:7]))), op(*args[:8], q_scale=None)]
    assert counted[op.__name__] == 2
    for out in through:
        assert torch.equal(_out(out), direct)


def test_calls_the_dispatcher_must_see_go_through_it(counted):
    op = torch.ops.mla.paged_decode
    x = make_decode_inputs([5, 70], num_heads=4, seed=3)
    args = x.args()
    want = op(*args)
    assert counted[op.__name__] == 0
    with torch.profiler.profile() as prof:  # the profiler records the op
        op(*args)
    assert counted[op.__name__] == 1 and any(e.name == "mla::paged_decode" for e in prof.events())
    with torch.device("cpu"):  # a TorchFunctionMode
        torch.testing.assert_close(op(*args), want)
    assert counted[op.__name__] == 2
    param = torch.nn.Parameter(args[0].clone(), requires_grad=False)  # a tensor subclass
    torch.testing.assert_close(op(param, *args[1:]), want)
    assert counted[op.__name__] == 3
    with FakeTensorMode() as mode:  # a dispatch mode: the fake implementation answers
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert isinstance(fake, FakeTensor) and fake.shape == want.shape and counted[op.__name__] == 4
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'q_nope'"):
        op(1.0, *args[1:])  # the dispatcher's own error, as before
    with pytest.raises(RuntimeError):
        op(*args[:5])  # too few arguments: the dispatcher's error
    assert counted[op.__name__] == 6
    needs_grad = args[0].clone().requires_grad_(True)  # the dispatcher's autograd fallback sees it
    torch.testing.assert_close(op(needs_grad, *args[1:]).detach(), want)
    assert counted[op.__name__] == 7
    with torch.no_grad():
        op(needs_grad, *args[1:])
    assert counted[op.__name__] == 7


def test_eager_direct_refuses_ops_it_cannot_serve():
    with pytest.raises(ValueError, match="write none of their arguments"):
        _library.define_op("mla_test_direct::writes", "(Tensor(a!) x) -> ()", lambda x: None, lambda x: None,
                           eager_direct=True)
    with pytest.raises(ValueError, match="Tensor, Tensor\\? and float arguments only"):
        _library.define_op("mla_test_direct::ints", "(Tensor x, int n) -> Tensor", lambda x, n: x,
                           lambda x, n: x, eager_direct=True)
