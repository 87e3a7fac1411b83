"""Measured selection (mla_inductor.tuning): stored results, keys, tie-breaking, refusals, when it is on.

Fake timings and a fake GPU environment: everything here runs on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mla_inductor
from mla_inductor import tuning
from mla_inductor.contract import DecodeProblem
from mla_inductor.selection import CallContext, select_backend

H100 = (("gpu", "NVIDIA H100 80GB HBM3"), ("capability", [9, 0]), ("version:flash_mla", "1.0.0"),
        ("version:flashinfer", "0.6.18.post1"), ("version:torch", "2.11.0+cu130"), ("version:triton", "3.6.0"),
        ("version:vllm", None))
CAPTURED = CallContext(calls_sharing_plan=61, captured=True)
# The table's row for this call, as selection.rank_backends gives it: usable backends in its order.
RANKED = [("triton", None), ("flashmla", None), ("flashinfer_fa3", None), ("flashinfer_fa2", "not installed"),
          ("reference", None)]


def problem(batch=32, heads=16, fmt="bf16"):
    return DecodeProblem(device_type="cuda", cache_format=fmt, q_dtype=torch.bfloat16, num_heads=heads,
                         kv_lora_rank=512, rope_dim=64, page_size=64, sparse=False, q_per_seq=1, batch=batch)


class FakeTimer:
    """Microseconds per round for each backend (the same in every round); counts its calls."""

    def __init__(self, us: dict):
        self.us = us
        self.calls = []

    def __call__(self, prob, shape, names, device):
        self.calls.append((prob, shape, tuple(names)))
        return {n: ([self.us[n]] * 3 if isinstance(self.us[n], float) else self.us[n]) for n in names}


def no_timing(*args):
    raise AssertionError("timed, where the stored result should have been read")


@pytest.fixture
def gpu_env(tmp_path, monkeypatch):
    """A tmp cache dir, an H100 with the tested versions, no file parsed yet."""
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(tuning.AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv(tuning.LENGTHS_ENV, raising=False)
    monkeypatch.setattr(tuning, "_environment", lambda: H100)
    monkeypatch.setattr(tuning, "_files", {})
    return tmp_path


def choose(prob=None, context=CAPTURED, ranked=RANKED):
    return tuning.measured_selection(prob or problem(), (9, 0), context, ranked)


def test_measured_choice_is_stored_atomically_and_read_back_without_timing(gpu_env):
    timer = FakeTimer({"triton": 30.0, "flashmla": 20.0, "flashinfer_fa3": 25.0})
    with tuning.autotuning("1"), tuning.timing_with(timer):
        first = choose()
    assert first.backend == "flashmla" and first.measurement.source == "measured"
    assert len(timer.calls) == 1 and timer.calls[0][2] == ("triton", "flashmla", "flashinfer_fa3"), \
        "the reference (last resort) and unusable backends are not timed"
    shape = timer.calls[0][1]
    assert shape.kind == "whole steps in CUDA graphs" and shape.varied and shape.batch == 32
    files = list((gpu_env / "selection").iterdir())
    assert [f.suffix for f in files] == [".json"], f"a temporary file was left behind: {files}"
    stored = json.loads(files[0].read_text())
    assert stored["environment"] == dict(H100) and len(stored["results"]) == 1
    assert "triton: measured 30.0 us" in " ".join(first.reasons)
    # A fresh process's state (nothing parsed yet), timing not even allowed: the stored result decides.
    tuning._files.clear()
    with tuning.timing_with(no_timing):
        again = choose()
    assert again.backend == "flashmla" and again.measurement.source == "stored"
    assert again.measurement.times == first.measurement.times


def test_a_second_process_reads_the_stored_result_and_times_nothing(gpu_env):
    with tuning.autotuning("1"), tuning.timing_with(FakeTimer({"triton": 9.0, "flashmla": 20.0,
                                                               "flashinfer_fa3": 25.0})):
        assert choose().backend == "triton"
    script = textwrap.dedent(f"""
        import torch
        from mla_inductor import tuning
        from mla_inductor.contract import DecodeProblem
        from mla_inductor.selection import CallContext
        tuning._environment = lambda: {H100!r}
        def boom(*a):
            raise SystemExit("timed")
        prob = DecodeProblem(device_type="cuda", cache_format="bf16", q_dtype=torch.bfloat16, num_heads=16,
                             kv_lora_rank=512, rope_dim=64, page_size=64, sparse=False, q_per_seq=1, batch=32)
        with tuning.autotuning("1"), tuning.timing_with(boom):
            sel = tuning.measured_selection(prob, (9, 0), CallContext(61, True), {RANKED!r})
        print(sel.backend, sel.measurement.source, tuning.timing_count())
    """)
    env = dict(os.environ, **{tuning.CACHE_DIR_ENV: str(gpu_env)})
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton", "stored", "0"]


def test_the_key_changes_with_the_gpu_and_the_library_versions(gpu_env, monkeypatch):
    with tuning.autotuning("1"), tuning.timing_with(FakeTimer({"triton": 9.0, "flashmla": 20.0,
                                                               "flashinfer_fa3": 25.0})):
        choose()
    base = dict(H100)
    for change in ({"gpu": "NVIDIA H200"}, {"version:flashinfer": "0.7.2.post1"}, {"version:torch": "2.12.0"},
                   {"capability": [10, 0]}):
        env = tuple({**base, **change}.items())
        assert tuning.environment_key(dict(env)) != tuning.environment_key(base), change
        monkeypatch.setattr(tuning, "_environment", lambda env=env: env)
        timer = FakeTimer({"triton": 30.0, "flashmla": 20.0, "flashinfer_fa3": 25.0})
        with tuning.autotuning("1"), tuning.timing_with(timer):
            assert choose().backend == "flashmla", f"{change}: the other environment's result was used"
        assert len(timer.calls) == 1


def test_the_class_key_separates_what_decides_the_choice(gpu_env):
    key = tuning.class_key
    base = key(problem(), CAPTURED, "1")
    assert key(problem(batch=20), CAPTURED, "1") == base, "batches of one table class share a result"
    different = [key(problem(batch=64), CAPTURED, "1"), key(problem(heads=128), CAPTURED, "1"),
                 key(problem(fmt="fp8_e4m3"), CAPTURED, "1"), key(problem(), None, "1"),
                 key(problem(), CallContext(1, True), "1"), key(problem(), CallContext(1, False), "1"),
                 key(problem(), CAPTURED, "all")]
    assert len({base, *different}) == len(different) + 1


def test_ties_within_three_percent_go_to_the_table_order(gpu_env):
    order = ["triton", "flashmla", "flashinfer_fa3"]
    assert tuning.winner_of({"triton": 10.25, "flashmla": 10.0, "flashinfer_fa3": 10.1}, order) == "triton"
    assert tuning.winner_of({"triton": 10.5, "flashmla": 10.0, "flashinfer_fa3": 10.1}, order) == "flashmla"
    assert tuning.winner_of({"triton": 10.5, "flashmla": 10.5, "flashinfer_fa3": 10.0}, order) == "flashinfer_fa3"
    # Rounds are reduced to their median: one slow round does not decide.
    timer = FakeTimer({"triton": [10.2, 10.2, 99.0], "flashmla": [10.0, 10.0, 10.0], "flashinfer_fa3": 50.0})
    with tuning.autotuning("1"), tuning.timing_with(timer):
        chosen = choose()
    assert chosen.backend == "triton" and "a tie" in " ".join(chosen.reasons)


def test_a_class_no_backend_runs_for_is_left_to_the_table_and_not_timed_again(gpu_env, monkeypatch):
    monkeypatch.setattr(tuning, "_unmeasurable", set())
    timer = FakeTimer({"triton": "RuntimeError: boom", "flashmla": "RuntimeError: boom",
                       "flashinfer_fa3": "RuntimeError: boom"})
    with tuning.autotuning("1"), tuning.timing_with(timer):
        assert choose() is None and choose() is None
    assert len(timer.calls) == 1 and not (gpu_env / "selection").exists()


def test_a_corrupt_tuning_file_is_refused_naming_it(gpu_env):
    path = tuning.results_file(dict(H100))
    path.parent.mkdir(parents=True)
    for text in ('{"format": 1, "environment": {}, "resu', '{"some": "other json"}',
                 json.dumps({"format": 1, "environment": dict(H100), "results": {"k": {"winner": "triton"}}})):
        path.write_text(text)
        tuning._files.clear()
        with tuning.autotuning("1"), tuning.timing_with(no_timing), \
                pytest.raises(tuning.TuningCacheError, match=str(path)):
            choose()
        assert path.read_text() == text, "the refused file must be left as it was"


def test_tuning_is_off_by_default_on_cpu_and_on_the_measured_gpu(gpu_env, monkeypatch):
    assert not tuning.timing_allowed("cpu", None)
    with tuning.autotuning("1"):
        assert not tuning.timing_allowed("cpu", None), "never on CPU, even when asked"
        if not torch.cuda.is_available():
            assert not tuning.autotune_enabled()
    assert tuning.why_auto("cuda", (9, 0)) is None and not tuning.timing_allowed("cuda", (9, 0))
    assert "sm80" in tuning.why_auto("cuda", (8, 0)) and tuning.timing_allowed("cuda", (8, 0))
    assert "sm100" in tuning.why_auto("cuda", (10, 0))
    newer = tuple({**dict(H100), "version:flashinfer": "0.7.2.post1"}.items())
    monkeypatch.setattr(tuning, "_environment", lambda: newer)
    assert "flashinfer 0.7.2.post1" in tuning.why_auto("cuda", (9, 0))
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    assert not tuning.timing_allowed("cuda", (8, 0))
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match="MLA_INDUCTOR_AUTOTUNE"):
        tuning.requested_mode()


def test_cpu_calls_never_time(gpu_env):
    cpu = DecodeProblem(device_type="cpu", cache_format="bf16", q_dtype=torch.bfloat16, num_heads=16,
                        kv_lora_rank=512, rope_dim=64, page_size=64, sparse=False, q_per_seq=1, batch=2)
    with tuning.autotuning("all"), tuning.timing_with(no_timing):
        selection = select_backend(cpu, None)
    assert selection.backend == "reference" and selection.measurement is None


def test_stored_results_are_used_where_timing_is_off_but_not_with_tuning_off(gpu_env, monkeypatch):
    with tuning.autotuning("1"), tuning.timing_with(FakeTimer({"triton": 30.0, "flashmla": 20.0,
                                                               "flashinfer_fa3": 25.0})):
        choose()
    with tuning.timing_with(no_timing):  # auto on the measured sm90: tuned ahead of time, so used
        assert choose().backend == "flashmla"
        assert choose(problem(heads=128)) is None, "a class without a result falls back to the table"
        with tuning.autotuning("0"):
            assert choose() is None
        with mla_inductor.prefer_backends("triton"):
            assert choose() is None, "a user's preference is taken as given"


def test_the_pass_cache_key_changes_with_the_tuning_result(gpu_env, monkeypatch):
    from mla_inductor.lowering.graph_pass import MLALoweringPass

    monkeypatch.setattr(tuning, "current_device_type", lambda: "cuda")
    monkeypatch.setattr(tuning, "current_capability", lambda: (9, 0))
    graph_pass = MLALoweringPass()
    before = graph_pass.uuid()
    assert graph_pass.uuid() == before
    with tuning.autotuning("1"), tuning.timing_with(FakeTimer({"triton": 30.0, "flashmla": 20.0,
                                                               "flashinfer_fa3": 25.0})):
        choose()
    stored = graph_pass.uuid()
    assert stored != before
    monkeypatch.setenv(tuning.LENGTHS_ENV, "equal")
    assert graph_pass.uuid() not in (before, stored)


def test_export_then_import_carries_every_result(gpu_env, tmp_path, monkeypatch):
    from mla_inductor.tune import main

    with tuning.autotuning("1"), tuning.timing_with(FakeTimer({"triton": 30.0, "flashmla": 20.0,
                                                               "flashinfer_fa3": 25.0})):
        choose()
    exported = tmp_path / "cluster.json"
    assert main(["--export", str(exported)]) == 0
    other = tmp_path / "other"
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(other))
    assert main(["--import", str(exported)]) == 0
    with tuning.timing_with(no_timing):
        assert choose().measurement.file.startswith(str(other))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["--import", str(bad)]) == 1


def test_a_decision_says_whether_a_measurement_or_the_table_chose(gpu_env):
    from mla_inductor.lowering.records import _as_json, _from_json, log_decision

    with tuning.autotuning("1"), tuning.timing_with(FakeTimer({"triton": 30.0, "flashmla": 20.0,
                                                               "flashinfer_fa3": 25.0})):
        selection = choose()
    decision = log_decision(problem(), (9, 0), selection, CAPTURED)
    assert decision.source == "measured" and dict(decision.measurement.times)["flashmla"] == 20.0
    assert "flashmla 20.0 us" in decision.measurement.describe()
    assert _from_json(json.loads(json.dumps(_as_json(decision)))) == decision
    table = log_decision(problem(), (9, 0), select_backend(problem(), (9, 0), available={"triton": None},
                                                           preference=("triton",)))
    assert table.source == "table"


def test_the_tune_command_on_cpu_says_it_needs_a_gpu(gpu_env):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "mla_inductor.tune", "--model", "deepseek-v3"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2, out.stderr
    assert "tuning needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- the timed program shapes (timing.py)

@pytest.fixture
def counted_backend(monkeypatch):
    """The test backend with a plan op (tests/planned_backend.py), its ops' calls counted by name."""
    import planned_backend as pb

    from mla_inductor import backends

    backends.register_backend("planned_test", "planned_backend")
    calls = []

    def counted(name, op):
        def call(*args):
            calls.append(name)
            return op(*args)
        return call

    monkeypatch.setattr(pb.BACKEND, "plan_op", lambda: counted("plan", torch.ops.mla_test.plan.default))
    monkeypatch.setattr(pb.BACKEND, "compiled_op", lambda: counted("run", torch.ops.mla_test.run.default))
    monkeypatch.setattr(pb.BACKEND, "decode_and_plan_op",
                        lambda: counted("decode_and_plan", torch.ops.mla_test.decode_and_plan.default)
                        if pb.BACKEND.plans_in_first_call else None)
    yield pb, calls
    backends.unregister_backend("planned_test")


def small_problem(sparse=False):
    return DecodeProblem(device_type="cpu", cache_format="bf16", q_dtype=torch.bfloat16, num_heads=2,
                         kv_lora_rank=32, rope_dim=16, page_size=4, sparse=sparse, topk=8 if sparse else None,
                         q_per_seq=1, batch=3)


@pytest.mark.parametrize("varied", [True, False])
@pytest.mark.parametrize("sparse", [False, True])
def test_timed_inputs_are_a_serving_batch(varied, sparse):
    from mla_inductor.timing import _inputs

    shape = tuning.ProgramShape("whole steps in CUDA graphs", 3, True, batch=3, seq_len=32, varied=varied)
    x = _inputs(small_problem(sparse), shape, torch.device("cpu"), shape.calls)
    lens = x["seq_lens"].tolist()
    assert all(4 <= n <= 32 for n in lens) and (len(set(lens)) > 1) == varied, lens
    assert len(x["caches"]) == 3 and x["caches"][0].data_ptr() != x["caches"][1].data_ptr(), \
        "each call of a step reads its own cache, as each layer does"
    if sparse:
        slots, page = x["sparse"].long(), 4
        for seq in range(3):  # every index a slot of its own sequence, below its length
            rows = x["block_table"][seq].long()
            pages, offsets = slots[seq] // page, slots[seq] % page
            positions = [int((rows == p).nonzero()[0]) * page + int(o) for p, o in zip(pages, offsets)]
            assert max(positions) < lens[seq]


@pytest.mark.parametrize("plans_in_first_call", [False, True], ids=["plan_op", "decode_and_plan"])
@pytest.mark.parametrize("calls", [8, 1])
def test_a_timed_step_plans_as_the_pass_writes_it(counted_backend, plans_in_first_call, calls, monkeypatch):
    """One plan per step shared by its calls (made by its first call where the decode makes it as a
    by-product); a call alone in its graph goes without where the run schedules itself."""
    from mla_inductor.timing import _inputs, _step_of

    pb, made = counted_backend
    monkeypatch.setattr(pb.BACKEND, "plans_in_first_call", plans_in_first_call)
    shape = tuning.ProgramShape("whole steps in CUDA graphs" if calls > 1 else "one-call graphs", calls, True,
                                batch=3, seq_len=16, varied=True)
    x = _inputs(small_problem(), shape, torch.device("cpu"), calls)
    host_plan, step = _step_of("planned_test", small_problem(), shape, x)
    step(host_plan())
    first = ["decode_and_plan"] if plans_in_first_call else ["plan", "run"]
    assert made == first + ["run"] * (calls - 1)
    made.clear()
    monkeypatch.setattr(pb.BACKEND, "plan_is_optional", True)
    host_plan, step = _step_of("planned_test", small_problem(), shape, x)
    step(host_plan())
    assert made == (["run"] if calls == 1 else first + ["run"] * (calls - 1))
    made.clear()
    monkeypatch.setattr(pb.BACKEND, "plan_is_optional", False)
    monkeypatch.setattr(pb.BACKEND, "plans_on_host", True, raising=False)
    host_plan, step = _step_of("planned_test", small_problem(), shape, x)
    held = host_plan()
    assert made == ["plan"], "a host plan is made apart from the step (outside a captured graph)"
    step(held)
    step(held)
    assert made == ["plan"] + ["run"] * 2 * calls
