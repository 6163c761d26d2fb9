"""bench/sass_loops.py: the loop finder on a hand-written listing, and the real kernel compiled for sm_90 on CPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("sass_loops", ROOT / "bench" / "sass_loops.py")
sass_loops = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(sass_loops)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.EX2 R2, R3 ;
        /*0020*/                   FADD R4, R2, 1 ;
        /*0030*/                   MUFU.RCP R4, R4 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   F2F.BF16.F32 R5, R4 ;
        /*0060*/                   F2FP.BF16.F32.PACK_AB R6, R4, R5 ;
        /*0070*/               @P1 BRA 0x50 ;
        /*0080*/                   BRA 0x90 ;
        /*0090*/                   EXIT ;
"""


def test_loops_are_the_backward_branches_and_xu_counts_mufu_and_one_value_casts():
    loops = sass_loops.loop_counts(LISTING, elements_per_thread=2)
    assert loops == [
        dict(instructions_per_element=4 / 2, xu_per_element=2 / 2),  # 0x10-0x40: two MUFU of four
        dict(instructions_per_element=3 / 2, xu_per_element=1 / 2),  # 0x50-0x70: F2F counts, F2FP does not
    ]


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas and cuobjdump ship in its Linux wheel")
def test_the_kernel_needs_two_then_three_xu_operations_per_logit():
    """exp2 and the reciprocal of the sigmoid in both passes, then the softmax's exp2 in the second (the first pass's
    exponential runs on the FMA pipe): one more would be a one-value cast or another MUFU operation back in a loop
    that Nsight Compute found bound by that pipe."""
    result = subprocess.run([sys.executable, "bench/sass_loops.py", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    loops = json.loads(result.stdout)
    assert len(loops) == 2
    assert [loop["xu_per_element"] for loop in loops] == [2.0, 3.0]
    assert all(loop["instructions_per_element"] > 3.0 for loop in loops)
