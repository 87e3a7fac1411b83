"""benchmarks/bench_distributed.py runs where it cannot measure: it says why and writes its files."""

import json
import subprocess
import sys

import pytest
import torch

from benchmark_modules import BENCHMARKS

ROOT = BENCHMARKS.parent


@pytest.mark.slow
def test_runs_and_skips_cleanly_without_two_gpus(tmp_path):
    # Part (c) only: on a GPU machine this must not start the one-GPU parts' minutes of timing.
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_distributed.py"), "--parts", "c",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "skipped:" in result.stdout
    results = json.loads((tmp_path / "bench_distributed.json").read_text())
    assert results["skipped"], results
    want = "c" if torch.cuda.is_available() else "all"
    assert want in results["skipped"]
    assert "skipped:" in (tmp_path / "bench_distributed.md").read_text()
