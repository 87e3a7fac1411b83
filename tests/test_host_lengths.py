"""Host copies of the lengths (``HostLengths``): what a plan that schedules on the host reads instead of
waiting for the device, and when it must not."""

import gc

import pytest
import torch

import mla_inductor
from mla_inductor.cache import HOST_LENGTHS, host_lengths


def small_cache(batch=3):
    return mla_inductor.PagedLatentCache.allocate(num_layers=1, batch_size=batch, max_seq_len=32, kv_lora_rank=32,
                                                  rope_dim=16, page_size=4)


def test_the_paged_cache_keeps_a_current_host_copy():
    cache = small_cache()
    assert torch.equal(host_lengths(cache.seq_lens), torch.zeros(3, dtype=torch.int32))
    for step in ([3, 5, 1], 1, 2):
        cache.reserve(step)
        host = host_lengths(cache.seq_lens)
        assert host is cache.host_seq_lens and torch.equal(host, cache.seq_lens)
    cache.reset(1)
    assert host_lengths(cache.seq_lens).tolist() == cache.seq_lens.tolist() == [6, 0, 4]


def test_a_view_at_the_same_address_is_the_same_lengths():
    cache = small_cache()
    cache.reserve([2, 3, 4])
    assert torch.equal(host_lengths(cache.seq_lens[:]), cache.seq_lens)
    assert host_lengths(cache.seq_lens[1:]) is None  # another address
    assert host_lengths(cache.seq_lens[:2]) is None  # another shape


def test_a_write_outside_the_cache_makes_the_copy_stale():
    cache = small_cache()
    cache.reserve(2)
    cache.seq_lens.add_(1)  # bumps the version counter
    assert host_lengths(cache.seq_lens) is None
    cache.reserve(1)
    assert host_lengths(cache.seq_lens).tolist() == [3, 3, 3]  # the cache's own view of its lengths


def test_user_registered_lengths_and_a_freed_tensor():
    seq_lens = torch.tensor([7, 9], dtype=torch.int32)
    mla_inductor.register_host_lengths(seq_lens, seq_lens.clone())
    assert host_lengths(seq_lens).tolist() == [7, 9]
    assert host_lengths(seq_lens.clone()) is None  # another tensor, another address
    key = (str(seq_lens.device), seq_lens.data_ptr())
    del seq_lens
    gc.collect()
    assert key not in HOST_LENGTHS._entries  # dropped with its tensor: the address may be reused


def test_a_bad_host_copy_is_refused_naming_what_is_expected():
    seq_lens = torch.tensor([7, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32 CPU tensor of seq_lens' shape"):
        mla_inductor.register_host_lengths(seq_lens, torch.tensor([7, 9]))


def test_forget_plans_drops_host_copies_and_stored_plans():
    from mla_inductor.backends._common import PlanCache

    cache = small_cache()
    cache.reserve(2)
    plans = PlanCache("test")
    plans.put("config", cache.block_table, cache.seq_lens, None, "a plan")
    assert plans.get("config", cache.block_table, cache.seq_lens, None) == "a plan"
    mla_inductor.forget_plans()  # after a write torch's version counter cannot see
    assert host_lengths(cache.seq_lens) is None
    assert plans.get("config", cache.block_table, cache.seq_lens, None) is None
