"""Machine-code counts of the soft-capped CE kernel's two loops, compiled for an H100/H200 (sm_90) on any machine.

No GPU needed: Triton's own ptxas and cuobjdump (shipped in its wheel) compile `train_gpt._softcap_ce_e5m2_kernel`
at the record's shapes and tile, with the 16-byte pointer alignment Triton's launcher assumes for torch tensors,
and this prints, per loop (the log-sum-exp pass, then the gradient pass), the instructions per logit and how many
of them run on the XU pipe (MUFU exp2/reciprocal and the one-value F2F cast). The Nsight Compute run of 2026-12-01 (bench/NOTES.md, commit f4e4aca) found
that pipe the kernel's busiest (bench/NOTES.md), so these counts predict a variant's cost before device time.

    python bench/sass_loops.py [--json]
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

VOCAB = 50304  # the padded vocabulary: the kernel's N
# Instruction at an address, with an optional predicate: "/*0330*/  @!P1 LDG.E.128 R8, desc[...] ;"
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)([^;]*);")
XU_PREFIXES = ("MUFU", "F2F.")  # F2FP (the two-value casts) runs elsewhere


def compile_kernel(block_m: int, block_n: int, warps: int) -> bytes:
    """The kernel's cubin for sm_90 with this tile and CUDA's instructions (HARDWARE=True)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import train_gpt as tg

    signature = {
        "logits_ptr": "*bf16", "targets_ptr": "*i64", "loss_ptr": "*fp32", "grad_ptr": "*u8", "grad_t_ptr": "*u8",
        "M": "i32", "N": "constexpr", "grad_inv_scale": "fp32", "CAP": "constexpr", "CAP_DIVISOR": "constexpr",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HARDWARE": "constexpr",
    }
    constants = {"N": VOCAB, "CAP": tg.SOFTCAP, "CAP_DIVISOR": tg.SOFTCAP_DIVISOR, "BLOCK_M": block_m, "BLOCK_N": block_n, "HARDWARE": True}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}  # the five pointers and M (49,152 = 16 * 3,072)
    source = ASTSource(fn=tg._softcap_ce_e5m2_kernel, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]


def disassemble(cubin: bytes, folder: Path) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = folder / "softcap_ce.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(tool), "--dump-sass", str(path)], capture_output=True, text=True, check=True).stdout


def loop_counts(sass: str, elements_per_thread: int) -> list[dict[str, float]]:
    """Per backward branch (a loop), in program order: instructions and XU operations per element of the tile."""
    instructions = [(int(address, 16), opcode, operands) for address, opcode, operands in INSTRUCTION.findall(sass)]
    loops = []
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target[1], 16) < address:
            body = [op for at, op, _ in instructions if int(target[1], 16) <= at <= address]
            loops.append(dict(
                instructions_per_element=len(body) / elements_per_thread,
                xu_per_element=sum(op.startswith(XU_PREFIXES) for op in body) / elements_per_thread,
            ))
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("sass_loops.py: needs Triton (pip install -r requirements.txt)")
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: its jit reads it then

    import train_gpt as tg

    block_m, block_n, warps = tg.SOFTCAP_CE_TILE[:3]
    with tempfile.TemporaryDirectory() as folder:
        loops = loop_counts(disassemble(compile_kernel(block_m, block_n, warps), Path(folder)), block_m * block_n // (32 * warps))
    if args.json:
        print(json.dumps(loops))
        return
    for name, counts in zip(("log-sum-exp pass", "gradient pass"), loops):
        print(f"{name}: {counts['instructions_per_element']:.1f} instructions per logit, {counts['xu_per_element']:.2f} on the XU pipe")


if __name__ == "__main__":
    main()
