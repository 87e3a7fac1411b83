"""benchmarks/kernel_sass.py: how it finds a kernel's loops in SASS (its compile is tests/test_decode_hopper.py's)."""

import pytest
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def sass():
    return load_benchmark("kernel_sass")


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FMUL R2, R2, R3 ;
        /*0020*/                   HGMMA.64x32x16.F32 R4, gdesc[UR4], R4 ;
        /*0030*/                   FMUL R2, R2, R3 ;
        /*0040*/              @P0  BRA 0x10 ;
        /*0050*/                   FADD R2, R2, R3 ;
        /*0060*/              @!P1 BRA 0x0 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x20 ;
"""


def test_innermost_loops_and_their_opcodes(sass):
    ins = sass.instructions(SASS)
    assert ins[4] == (0x40, "BRA 0x10")  # the predicate is dropped
    loops = sass.loops(ins, least=2)
    # 0x10-0x40 is the innermost loop; 0x0-0x60 holds it; the branch after EXIT is out-of-line code, not a loop.
    assert [(f, l) for f, l, _ in loops] == [(0x10, 0x40)]
    assert loops[0][2] == {"FMUL": 2, "HGMMA.64x32x16.F32": 1, "BRA": 1}


def test_short_backward_branches_are_not_loops(sass):
    assert sass.loops(sass.instructions(SASS), least=10) == []
