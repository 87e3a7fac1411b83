"""benchmarks/ncu_source.py: reading Nsight Compute's source export and summing its samples by region and opcode."""

import gzip

import pytest
from benchmark_modules import load_benchmark

EXPORT = '''"Kernel Name","k",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x1000","      LDG.E.128 R4, desc[UR4][R2.64]","10","9"
"0x1010","      F2FP.F16.E4M3.UNPACK_B R8, R4","30","30"
"0x1020","@P0   BRA 0x1000","5","5"
"0x2000","      HGMMA.64x32x16.F32 R24, gdesc[UR8], R24","40","40"
"0x2010","      WARPGROUP.DEPBAR.LE gsb0, 0x0","15","15"
"0x2020","      FADD R2, R2, R3","0","0"
'''


@pytest.fixture(scope="module")
def ncu():
    return load_benchmark("ncu_source")


def test_regions_and_opcodes_from_a_gzipped_export(ncu, tmp_path):
    path = tmp_path / "prof.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(EXPORT)
    rows = ncu.read_export(str(path))
    assert rows[2] == (0x1020, "@P0   BRA 0x1000", 5.0)
    assert ncu.opcode(rows[2][1]) == "BRA"
    regions = [ncu.parse_region("mma=HGMMA:0:0x10"), ncu.parse_region("widen=F2FP:0x10:0x10")]
    lines = ncu.summarize(rows, regions, top=2)
    assert lines[0] == "100 samples"
    assert lines[1] == "mma: 55 samples, 55.0% of all"  # the HGMMA and the wait after it, not the FADD past 0x10
    assert lines[2].split() == ["HGMMA.64x32x16.F32", "40", "72.7%"]
    assert lines[4] == "widen: 45 samples, 45.0% of all"
    assert lines[-2].split()[:2] == ["+0x01000", "40"]  # the instructions with the most samples, from the first


def test_a_bad_region_names_the_form(ncu):
    with pytest.raises(SystemExit, match="NAME=OPCODE:BEFORE:AFTER"):
        ncu.parse_region("mma=HGMMA:0")
    with pytest.raises(SystemExit, match="byte counts"):
        ncu.parse_region("mma=HGMMA:x:0")
