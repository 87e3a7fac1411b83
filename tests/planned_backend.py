"""A test backend with a plan op, to check that the pass plans once per forward on any machine.

Its plan is a copy of seq_lens (the run checks it got the plan of its own lengths), kept in a ``PlanCache``
like a real backend's: ``PLANS_MADE`` counts the plans actually computed, so tests see one plan per step
however the step is split.
"""

from typing import Optional

import torch

from mla_inductor.backends import Backend
from mla_inductor.backends._common import PlanCache
from mla_inductor.contract import empty_decode_outputs
from mla_inductor.reference import paged_decode_reference

PLANS = PlanCache("planned_test")
PLANS_MADE: list[int] = []  # one entry per plan computed (not served from PLANS)


@torch.library.custom_op("mla_test::plan", mutates_args=())
def plan(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
         seq_lens: torch.Tensor, softmax_scale: float, kv_scale: torch.Tensor,
         sparse_indices: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    config = (tuple(q_nope.shape), q_nope.dtype, tuple(kv_cache.shape[1:]), kv_cache.dtype, softmax_scale)
    made = PLANS.get(config, block_table, seq_lens, sparse_indices)
    if made is None:
        PLANS_MADE.append(1)
        made = seq_lens.clone()
        PLANS.put(config, block_table, seq_lens, sparse_indices, made)
    return [made.clone()]  # a copy: Inductor may reuse an op's output memory


@plan.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    return [torch.empty_like(seq_lens)]


@torch.library.custom_op("mla_test::run", mutates_args=())
def run(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
        seq_lens: torch.Tensor, softmax_scale: float, kv_scale: torch.Tensor, sparse_indices: Optional[torch.Tensor],
        plan: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    assert (not plan and BACKEND.plan_is_optional) or (len(plan) == 1 and torch.equal(plan[0], seq_lens)), \
        "run got a stale or foreign plan, or none though it needs one"
    out, lse = paged_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                      sparse_indices)
    return out.contiguous(), lse.contiguous()


@run.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    return empty_decode_outputs(q_nope)


@torch.library.custom_op("mla_test::run_out", mutates_args=())
def run_out(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, softmax_scale: float, kv_scale: torch.Tensor,
            sparse_indices: Optional[torch.Tensor], plan: list[torch.Tensor]) -> torch.Tensor:
    return run(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan)[0]


@run_out.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    return empty_decode_outputs(q_nope)[0]


@torch.library.custom_op("mla_test::decode_and_plan", mutates_args=())
def decode_and_plan(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, softmax_scale: float, kv_scale: torch.Tensor,
                    sparse_indices: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    made = plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
    return list(run(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                    made)) + made


@decode_and_plan.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    return list(empty_decode_outputs(q_nope)) + [torch.empty_like(seq_lens)]


class PlannedBackend(Backend):
    name = "planned_test"
    plans_in_first_call = False  # tests switch on decode_and_plan_op
    has_out_only = False  # and out_only_op

    def supports(self, problem, capability):
        return None

    def compiled_op(self):
        return torch.ops.mla_test.run.default

    def plan_op(self):
        return torch.ops.mla_test.plan.default

    def decode_and_plan_op(self):
        return torch.ops.mla_test.decode_and_plan.default if self.plans_in_first_call else None

    def out_only_op(self):
        return torch.ops.mla_test.run_out.default if self.has_out_only else None

    def decode(self, *args):
        return run(*args, plan(*args))


BACKEND = PlannedBackend()
