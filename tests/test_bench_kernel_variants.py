"""benchmarks/bench_kernel_variants.py: what its --cases accept (the script itself needs a GPU)."""

import pytest
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def variants():
    return load_benchmark("bench_kernel_variants")


@pytest.mark.parametrize("item,expected", [("128x128x4096:fp8", ((128, 128, 4096), "fp8")),
                                           ("64x64x8192", ((64, 64, 8192), "bf16")),
                                           ("128x128x16384x2048:ds", ((128, 128, 16384, 2048), "ds")),
                                           ("4x40x1000x256:bf16", ((4, 40, 1000, 256), "bf16"))])
def test_cases_dense_and_sparse(variants, item, expected):
    assert variants.parse_case(item) == expected


@pytest.mark.parametrize("item,says", [("128x128:fp8", "BxHxS"), ("axbxc:ds", "BxHxS"),
                                       ("128x128x4096:fp16", "fmt must be one of bf16, fp8, ds"),
                                       ("128x128x4096x2048:fp8", "fmt must be one of bf16, ds")])
def test_bad_cases_name_the_case_and_what_is_expected(variants, item, says):
    with pytest.raises(SystemExit, match=says):
        variants.parse_case(item)


def test_a_negative_launch_count_is_refused_before_any_gpu_work(variants):
    with pytest.raises(SystemExit, match="--launches: expected a count >= 0"):
        variants.main(["--launches=-1"])
