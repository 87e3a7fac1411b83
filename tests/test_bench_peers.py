"""The peers' direct step (``benchmarks/peers.py``), the one step bench_modes and bench_host_overhead both time
as "the fastest peer's direct call": made on CPU with stand-in peers (the real ones need a GPU).

What must hold for the two scripts' best peers to mean the same thing: each peer function is made once per
layer entry (its plan, schedule and quantized query made there) and never in the timed loop; call i reads
layer i % n; both scripts take the format's peers from ``DIRECT_PEERS`` through ``direct_steps``; and
bench_host_overhead runs its torch.profiler pass only after every row is timed (a finished profiler session
slows later CUDA calls).
"""

from __future__ import annotations

import pytest
import torch

from benchmark_modules import BENCHMARKS, load_benchmark

peers = load_benchmark("peers")


class StandInPeer:
    """A peer maker recording what each function is made with and which function each call runs."""

    def __init__(self):
        self.made: list[dict] = []
        self.calls: list[int] = []

    def __call__(self, c: dict):
        index = len(self.made)
        self.made.append(c)
        out = torch.full((c["B"], 1, c["H"], 512), float(index))

        def call():
            self.calls.append(index)
            return out

        return call


def _missing(c):
    raise peers.PeerMissing("somepeer is not installed (pip install somepeer)")


def _broken(c):
    raise RuntimeError("no kernel for this shape")


def _case(B: int = 2, H: int = 4, pages: int = 3, fmt: str = "bf16") -> "peers.FormatCase":
    """A FormatCase on CPU, small: random q [B, H, 576], cache [pages, 64, 576]."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 576, generator=g).to(torch.bfloat16)
    cache = torch.randn(pages, 64, 576, generator=g).to(torch.bfloat16)
    key = "cache" if fmt == "bf16" else "cache_fp8"
    c = dict(B=B, H=H, S=64, page=64, q=q, lens=torch.full((B,), 64, dtype=torch.int32),
             block_table=torch.arange(B, dtype=torch.int32).reshape(B, 1), scale=0.1, **{key: cache})
    return peers.FormatCase(B, H, fmt, c, cache, torch.ones(1), key, torch.zeros(B, H, 512), c["lens"].clone())


def test_a_direct_step_makes_each_peer_function_once_per_layer_and_only_calls_it_in_the_loop():
    layers = [{"q": torch.full((2, 4, 576), float(i))} for i in range(3)]
    peer = StandInPeer()
    step = peers.direct_step("p", dict(B=2, H=4, q=None), 7, layers, makers={"p": peer})
    assert [m["q"][0, 0, 0].item() for m in peer.made] == [0.0, 1.0, 2.0]  # each layer's own entries
    assert peer.calls == [0] + [0, 1, 2, 0, 1, 2, 0]  # the first output, then one untimed step
    assert step.first.shape == (2, 4, 512) and step.first.eq(0).all()
    peer.calls.clear()
    outputs = step.run()
    assert peer.calls == [0, 1, 2, 0, 1, 2, 0] and len(peer.made) == 3  # the timed loop makes nothing
    # The step's outputs live until it ends, as those of our op's step (each call writes fresh memory).
    assert [out[0, 0, 0, 0].item() for out in outputs] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]


def test_direct_steps_time_the_peers_that_run_and_name_the_others():
    makers = {"ok": StandInPeer(), "absent": _missing, "broken": _broken}
    steps, not_timed = peers.direct_steps(("absent", "ok", "broken"), dict(B=1, H=2), 3, makers=makers)
    assert list(steps) == ["ok"]
    assert not_timed["absent"].startswith("not installed: somepeer is not installed")
    assert not_timed["broken"] == "failed: RuntimeError: no kernel for this shape"


def test_the_fastest_is_the_smallest_time_of_those_given():
    assert peers.fastest({}) == (None, None)
    assert peers.fastest({"a": 2.0, "b": 1.5, "c": 3.0}) == ("b", 1.5)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_back_to_back_inputs_give_each_call_its_own_query_and_cache(fmt):
    case = _case(fmt=fmt)
    qs, caches, layers = peers.back_to_back_inputs(case, 5)
    assert len(qs) == 5 and qs[0] is case.c["q"] and len({q.data_ptr() for q in qs}) == 5
    assert len(caches) == 5 and caches[0] is case.kv_cache and len({k.data_ptr() for k in caches}) == 5
    assert all(torch.equal(k, case.kv_cache) for k in caches)
    assert [(entry["q"], entry[case.cache_key]) for entry in layers] == list(zip(qs, caches))
    size = case.kv_cache.numel() * case.kv_cache.element_size()
    assert len(peers.back_to_back_inputs(case, 5, cache_budget=2 * size)[1]) == 2  # copies reused past it
    assert len(peers.back_to_back_inputs(case, 5, cache_budget=0)[1]) == 1


def test_every_format_has_its_direct_peers():
    assert set(peers.DIRECT_PEERS) == {"bf16", "fp8_e4m3"}
    for fmt, names in peers.DIRECT_PEERS.items():
        assert set(names) <= set(peers.PEERS), fmt
        assert all(name.endswith("fp8") == (fmt == "fp8_e4m3") for name in names), fmt


def test_bench_modes_times_the_formats_direct_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_modes = load_benchmark("bench_modes")
    case = _case(fmt="fp8_e4m3")
    stand_ins = {name: StandInPeer() for name in peers.DIRECT_PEERS["fp8_e4m3"]}
    absent = peers.DIRECT_PEERS["fp8_e4m3"][0]
    for name, maker in stand_ins.items():
        monkeypatch.setitem(peers.PEERS, name, _missing if name == absent else maker)
    qs, caches, layers = peers.back_to_back_inputs(case, 4)
    results = bench_modes.Results()
    steps = bench_modes.peer_steps(case, 4, layers, results, "a")
    assert set(steps) == set(stand_ins) - {absent}
    assert results.skipped["a"] == [f"peer {absent}: not installed: somepeer is not installed (pip install somepeer)"]
    for name in steps:
        assert [m["q"] for m in stand_ins[name].made] == qs  # one function per call's query and cache
        assert [m["cache_fp8"] for m in stand_ins[name].made] == caches


def test_bench_host_overhead_profiles_only_after_every_real_row_is_timed(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_host_overhead")
    events = []

    def timed(B, H, fmt, args):
        events.append(("timed", fmt))
        return {"case": f"B={B} H={H} {fmt}", "peer": 1.0, "eager": 2.0, "compiled": 2.0}

    monkeypatch.setattr(bench, "time_real_case", timed)
    monkeypatch.setattr(bench, "profile_real_case", lambda B, H, fmt, args, row: events.append(("profiled", fmt)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    bench.main(["--device", "cuda", "--real", "--real-only", "--cases", "1x128:bf16,1x128:fp8_e4m3"])
    assert events == [("timed", "bf16"), ("timed", "fp8_e4m3"), ("profiled", "bf16"), ("profiled", "fp8_e4m3")]
    assert "B=1 H=128 fp8_e4m3" in capsys.readouterr().out


def test_both_scripts_read_cases_alike(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    report = load_benchmark("report")
    assert report.parse_cases("1x128:fp8_e4m3,32x16") == [(1, 128, "fp8_e4m3"), (32, 16, "bf16")]
    for script in ("bench_modes", "bench_host_overhead"):
        assert load_benchmark(script).parse_cases is report.parse_cases, script


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["whole", "per_layer"])
def test_bench_modes_part_d_steps_the_hf_model_on_cpu(mode):
    """Part d's step runs the current HF integration (register + PagedMLACache + decode_one_token) end to end:
    a tiny model on CPU, compiled whole or per layer, the layers' forwards restored afterwards."""
    pytest.importorskip("transformers")
    import argparse

    load_benchmark("report")  # imported by name by the scripts below
    bench_e2e = load_benchmark("bench_e2e")
    bench_modes = load_benchmark("bench_modes")
    from mla_inductor import hf

    args = argparse.Namespace(small=True, layers=2, intermediate=64, vocab=256)
    model = bench_e2e.build_model(args, torch.device("cpu"), torch.float32)
    result = bench_modes.hf_step_ms(model, hf, bench_e2e, "bf16", 2, mode, context=16, warmup=1, iters=2,
                                    device="cpu", profile=mode == "per_layer", rounds=2)
    assert result["ms"] > 0 and 0 < result["host_ms"] <= result["ms"] * 1.01, result
    assert all("forward" not in vars(layer) for layer in model.model.layers)


def test_bench_modes_part_d_options_parse():
    load_benchmark("report")
    bench_modes = load_benchmark("bench_modes")
    assert bench_modes._d_configs("fp8_e4m3:1,bf16:64") == [("fp8_e4m3", 1), ("bf16", 64)]
    with pytest.raises(Exception, match="fmt:B"):
        bench_modes._d_configs("fp8_e4m3")


def _reads_a_length_on_the_host(x):
    return int(x.sum().item())


def test_step_profile_names_who_waits_for_the_device():
    """bench_modes --d-profile and bench_generate --trace list who called each device wait / copy: a step
    reading a value on the host shows that function as the caller of the read."""
    report = load_benchmark("report")
    x = torch.arange(8)
    text = report.step_profile(lambda: _reads_a_length_on_the_host(x), "cpu", steps=2)
    line = next(row for row in text.splitlines() if "aten::_local_scalar_dense <-" in row)
    assert "_reads_a_length_on_the_host" in line and line.split()[0] == "2", line


def test_bench_modes_part_b_rounds_keep_each_cells_fastest_and_the_first_rounds_backends(monkeypatch):
    """``--b-rounds``: each cell (the peer's time too) is the fastest of the rounds, ratios are recomputed from
    them, and the backend names are the first round's (later rounds' graphs record no new decision)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_modes = load_benchmark("bench_modes")
    peer_times = iter([30.0, 20.0, 25.0])  # ms -> the best peer per round: 30, 20, 25 ms
    ours = iter([90.0, 40.0, 50.0, 35.0, 70.0, 60.0])  # (compiled, cudagraphs) per round, default row only
    floors = iter([5.0, 9.0, 4.0, 12.0, 6.0, 10.0])
    rounds_seen = []
    events = []

    def time_ours(case, qs, caches, mode, row, views=False):
        events.append("ours")
        row[f"{mode}_us"] = next(ours)
        row[f"{mode}_backend"] = "triton" if not rounds_seen else "cached graph"
        if mode == "cudagraphs":
            rounds_seen.append(1)

    monkeypatch.setattr(bench_modes, "peer_steps", lambda *a: {"fa3": type("S", (), {"run": None})()})
    monkeypatch.setattr(bench_modes, "median_ms", lambda run: events.append("peer") or next(peer_times) / 1e3)
    monkeypatch.setattr(bench_modes, "_time_ours", time_ours)
    monkeypatch.setattr(bench_modes, "floor_us", lambda case, qs, caches, mode: next(floors))
    case = type("C", (), {"c": {"q": None}, "kv_cache": None, "label": "B=1 H=128 bf16", "fmt": "bf16"})()
    results = bench_modes.Results()
    bench_modes.one_call(case, results, rounds=3)
    (row,) = results.rows["b"]
    assert (row["peer_us"], row["compiled_us"], row["cudagraphs_us"]) == (20.0, 50.0, 35.0)
    assert (row["compiled_floor_us"], row["cudagraphs_floor_us"]) == (4.0, 9.0)
    assert row["compiled_ratio"] == 50.0 / 20.0 and row["cudagraphs_ratio"] == 35.0 / 20.0
    assert row["compiled_backend"] == row["cudagraphs_backend"] == "triton"
    # every other round times ours first: a drift during the case favours neither side
    assert events == ["peer", "ours", "ours"] + ["ours", "ours", "peer"] + ["peer", "ours", "ours"]


def test_bench_modes_holds_an_fp8_case_against_peers_of_its_query_precision(monkeypatch):
    """An fp8_e4m3 case gets a row per query precision: q in bf16 (our default) against the peers keeping q in
    bf16 only, and q in e4m3 (our op under ``allow_fp8_query``) against every peer. Parts a and b alike."""
    from mla_inductor.selection import fp8_query_allowed

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_modes = load_benchmark("bench_modes")
    e4m3_peer, bf16_peer = sorted(peers.QUERY_IN_E4M3)[0], "flashinfer_fa3_fp8"
    peer_ms = {e4m3_peer: 10.0, bf16_peer: 30.0}  # the e4m3-query peer is the faster
    steps = {name: type("S", (), {"run": name, "first": None})() for name in peer_ms}
    opted_in = []

    def time_ours(case, qs, caches, mode, row, views=False):
        opted_in.append(fp8_query_allowed())
        row[f"{mode}_us"] = 1.0

    monkeypatch.setattr(bench_modes, "peer_steps", lambda *a: steps)
    monkeypatch.setattr(bench_modes, "median_ms", lambda run: peer_ms[run] / 1e3 * bench_modes.CALLS)
    monkeypatch.setattr(bench_modes, "_time_ours", time_ours)
    monkeypatch.setattr(bench_modes, "floor_us", lambda *a: 1.0)
    monkeypatch.setattr(bench_modes, "relative_error", lambda *a: 0.0)
    monkeypatch.setattr(peers, "back_to_back_inputs", lambda case, calls: ([], [], []))
    case = type("C", (), {"c": {"q": None}, "kv_cache": None, "label": "B=1 H=128 fp8_e4m3", "fmt": "fp8_e4m3",
                          "reference": None})()
    results = bench_modes.Results()
    bench_modes.back_to_back(case, results, bench_modes.Deadline(60), rounds=2)
    rows = results.rows["a"]
    assert [(r["case"], r["best_peer"], round(r["peer_us"], 6)) for r in rows] == [
        ("B=1 H=128 fp8_e4m3, bf16 q", bf16_peer, 30.0),
        ("B=1 H=128 fp8_e4m3, e4m3 q (allow_fp8_query)", e4m3_peer, 10.0),
    ]
    assert opted_in == ([False] * 3 + [True] * 3) * 2  # eager, compiled, CUDA graphs per row, two rounds
    assert not fp8_query_allowed()

    peer_ms = {name: ms / bench_modes.CALLS for name, ms in peer_ms.items()}  # part b: single calls
    monkeypatch.setattr(bench_modes, "median_ms", lambda run: peer_ms[run] / 1e3)
    opted_in.clear()
    bench_modes.one_call(case, results)
    assert [(r["case"], r["best_peer"]) for r in results.rows["b"]] == [
        ("B=1 H=128 fp8_e4m3, bf16 q", bf16_peer), ("B=1 H=128 fp8_e4m3, e4m3 q (allow_fp8_query)", e4m3_peer)]
    assert opted_in == [False] * 2 + [True] * 2


@pytest.mark.slow
def test_our_step_on_query_views_makes_the_same_calls():
    """``report.decode_calls(views=True)`` over ``query_views`` (bench_modes --a-query-views: each call's
    q_nope / q_pe made before the step, as the peers' are) computes what the step slicing each query does,
    eager and compiled."""
    import mla_inductor
    from mla_inductor.testing import make_decode_inputs

    report = load_benchmark("report")
    x = make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=512, rope_dim=64, page_size=4,
                           q_dtype=torch.float32)
    qs = [torch.cat([x.q_nope, x.q_pe], -1) * s for s in (1.0, 0.5, 2.0)]
    args = ([x.kv_cache], x.block_table, x.seq_lens, x.kv_scale)
    sliced = report.decode_calls(0.1)(qs, *args)
    for step in (report.decode_calls(0.1, views=True), torch.compile(report.decode_calls(0.1, views=True))):
        with mla_inductor.prefer_backends("reference"):
            got = step(report.query_views(qs), *args)
        assert len(got) == 3 and all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, sliced))
    assert not torch.allclose(sliced[0], sliced[1])  # the calls differ: each call got its own query


def test_bench_modes_rows_with_a_backend_preferred():
    """Parts a and b give each query class a row as the op chooses, then one per backend named."""
    load_benchmark("report")
    bench_modes = load_benchmark("bench_modes")
    variants = bench_modes.variants_of(_case(fmt="fp8_e4m3"), ("triton",))
    assert [(v[1], v[2]) for v in variants] == [(False, None), (False, "triton"), (True, None), (True, "triton")]
    labels = [bench_modes.variant_label(_case(fmt="bf16"), v) for v in bench_modes.variants_of(_case(fmt="bf16"),
                                                                                               ("triton",))]
    assert labels[1] == labels[0] + ", triton preferred"


def test_a_case_of_varied_lengths_says_so():
    import dataclasses

    case = _case()
    assert dataclasses.replace(case, varlen=True).label == case.label + " varlen"
