"""Can a persistent Triton matmul with ReLU² in its epilogue beat cuBLAS + inductor's ReLU² kernels? One GPU.

The MLP's two matmuls with a hidden-size output (record micro-step: 49,152 tokens, 768 -> 3,072, bf16) were each
followed by a memory-bound pointwise kernel in train_gpt.py (session 11 profile, one H200: 12.3 ms per step
forward, 18.2 backward, both at about 4.3 TB/s). Fused into the matmul's epilogue they would save about 0.2 ms
per MLP if the matmul kept up with cuBLAS; session 3's non-persistent Triton matmul reached 513 of cuBLAS's 673
TFLOP/s and lost (bench/NOTES.md). In session 12 this script found the backward's fusion faster and the
forward's slower; the backward's is in train_gpt.py since. It times, per tile configuration:
  * the plain matmul (epilogue 0) against cuBLAS `x @ w`;
  * the forward epilogue (1: `pre` and `relu(pre)^2`, both bf16) against cuBLAS + a compiled ReLU²;
  * the backward: train_gpt.relu2_backward_matmul (what training runs since session 12: `grad_h * 2 relu(pre)`
    where `pre > 0`, else 0, in the epilogue) at the configuration's tile, against cuBLAS + the compiled
    pointwise backward (not for warp-specialized tiles, which that kernel does not take),
each as the median ratio over pairs timed back to back, orders alternating (session 11's first version timed
cuBLAS once before and once after the sweep: 0.324 and 0.359 ms; the SM clock read 1650-1980 MHz meanwhile).
It checks that the forward epilogue gives bitwise the unfused formula applied to the same kernel's plain product
and the backward bitwise cuBLAS + the unfused formula, and prints how many product elements differ from cuBLAS's
(sessions 11-12, one H200: none, in every configuration).

    python bench/bench_relu2_matmul.py        # one GPU (Hopper for TMA descriptors), about two minutes
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

CALLS_PER_TIMING = 5  # back to back, so each launch's host work (descriptors, allocation) hides behind the last

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: the tests skip, main() refuses
    triton = None

TOKENS, DIM, HIDDEN = 49152, 768, 3072
PLAIN, FORWARD = 0, 1
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, warp_specialize)
CONFIGS = (  # session 11 on an H200: 128x256 and 256x128 with 3 stages, and 128x128x128, exceed shared memory
    (128, 128, 64, 4, 4, False),
    (128, 128, 64, 4, 4, True),
    (128, 128, 64, 3, 4, True),
    (128, 128, 64, 5, 4, True),
    (128, 128, 64, 4, 8, False),
    (128, 256, 64, 2, 8, False),
    (128, 256, 64, 2, 8, True),
    (64, 256, 64, 4, 4, False),
)


def relu2_eager(pre: torch.Tensor) -> torch.Tensor:
    """The forward pointwise of train_gpt.MLP: relu(pre).square() (fp32 arithmetic, one rounding)."""
    return F.relu(pre).square()


if triton is not None:

    @triton.jit
    def _relu2_matmul_kernel(
        a_desc, b_desc, out_desc, aux_desc, M, N,
        TILES_PER_PROGRAM: tl.constexpr, K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr, EPILOGUE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    ):
        """out = a @ b (a M x K, b K x N, row-major, fp32 accumulation, one rounding to a's dtype), then by
        EPILOGUE: PLAIN stores it; FORWARD stores it and relu(it)^2 into aux (the backward's epilogue lives in
        train_gpt.py's _relu2_backward_matmul_kernel, the same loop). Persistent: NUM_PROGRAMS programs walk the tiles,
        GROUP_M row tiles at a time so that neighbours share a's rows in L2. Every program runs the same number
        of tiles (a uniform trip count, which the CPU interpreter also needs); a program past the end redoes the
        last tile, storing the same values. Trip counts are compile-time constants: one shape per compile, as
        in training, and the interpreter cannot loop to a runtime bound."""
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        for i in tl.range(0, TILES_PER_PROGRAM, flatten=True, warp_specialize=WARP_SPECIALIZE):
            tile = tl.minimum(tl.program_id(0) + i * NUM_PROGRAMS, tiles_m * tiles_n - 1)
            group_first_m = (tile // (GROUP_M * tiles_n)) * GROUP_M
            group_rows = tl.minimum(tiles_m - group_first_m, GROUP_M)
            m = (group_first_m + tile % group_rows) * BLOCK_M
            n = (tile % (GROUP_M * tiles_n)) // group_rows * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(K_STEPS):
                acc = tl.dot(a_desc.load([m, kk * BLOCK_K]), b_desc.load([kk * BLOCK_K, n]), acc)
            product = acc.to(out_desc.dtype)
            out_desc.store([m, n], product)
            if EPILOGUE == 1:
                r = product.to(tl.float32)
                r = tl.where(r < 0, 0.0, r)  # relu that keeps NaN, as torch's does
                aux_desc.store([m, n], (r * r).to(out_desc.dtype))


def relu2_matmul(a: torch.Tensor, b: torch.Tensor, epilogue: int, config: tuple, num_programs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launches _relu2_matmul_kernel; returns (out, aux): FORWARD's aux is relu(out)^2, PLAIN's None."""
    block_m, block_n, block_k, stages, warps, warp_specialize = config
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    aux = torch.empty_like(out) if epilogue == FORWARD else None
    descriptors = (
        TensorDescriptor.from_tensor(a, [block_m, block_k]),
        TensorDescriptor.from_tensor(b, [block_k, block_n]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        TensorDescriptor.from_tensor(out if aux is None else aux, [block_m, block_n]),
    )
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = min(num_programs, tiles)
    _relu2_matmul_kernel[(programs,)](
        *descriptors, M, N, TILES_PER_PROGRAM=triton.cdiv(tiles, programs), K_STEPS=triton.cdiv(K, block_k), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        NUM_PROGRAMS=programs, EPILOGUE=epilogue, WARP_SPECIALIZE=warp_specialize, num_stages=stages, num_warps=warps,
    )
    return out, aux


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits wherever a is a number, NaN at the same places (NaN payloads and signs may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    same_bits = (a.view(as_int) == b.view(as_int)) | nan
    return torch.equal(nan, b.isnan()) and bool(same_bits.all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timings per median, each of %d calls back to back" % CALLS_PER_TIMING)
    parser.add_argument("--pairs", type=int, default=4, help="reference/fused pairs per kind and configuration, orders alternating")
    args = parser.parse_args()
    if not torch.cuda.is_available() or triton is None or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("bench_relu2_matmul.py: needs a CUDA GPU with TMA (compute capability 9.0 or newer) and Triton.")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = F.rms_norm(torch.randn(TOKENS, DIM, device="cuda"), (DIM,)).bfloat16()
    w = (torch.randn(DIM, HIDDEN, device="cuda") * DIM**-0.5).bfloat16()
    grad_out = torch.randn(TOKENS, DIM, device="cuda").bfloat16()
    w_proj = (torch.randn(DIM, HIDDEN, device="cuda") * 0.02).bfloat16()
    pre = x @ w
    relu2_compiled = torch.compile(relu2_eager, fullgraph=True)
    backward_compiled = torch.compile(train_gpt.relu2_backward_eager, fullgraph=True)
    flops = 2 * TOKENS * DIM * HIDDEN
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {sms} SMs; "
          f"{TOKENS} x {DIM} @ {DIM} x {HIDDEN} bf16, {args.repeats} calls per median")

    def ms_per_call(fn) -> float:
        return median_ms(lambda: [fn() for _ in range(CALLS_PER_TIMING)], args.repeats) / CALLS_PER_TIMING

    references = (
        ("plain", lambda: x @ w),
        ("forward", lambda: relu2_compiled(x @ w)),
        ("backward", lambda: backward_compiled(grad_out, w_proj, pre)),
    )
    for config in CONFIGS:
        name = "{}x{}x{} s{} w{}{}".format(*config[:5], " ws" if config[5] else "")
        try:
            plain, _ = relu2_matmul(x, w, PLAIN, config, sms)
            fwd_out, fwd_aux = relu2_matmul(x, w, FORWARD, config, sms)
            bwd_out = None if config[5] else train_gpt.relu2_backward_matmul(grad_out, w_proj, pre, config[:5], sms)
        except (triton.CompilationError, triton.runtime.errors.OutOfResources, RuntimeError) as error:
            # what Triton raises for a configuration it cannot build or fit (its MLIR passes fail as RuntimeError);
            # a CUDA error is not that, and would leave every later configuration on a broken context
            if isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error):
                raise
            print(f"{name}: not built: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        exact = (
            bitwise_equal(fwd_out, plain)
            and bitwise_equal(fwd_aux, relu2_eager(plain))
            and (bwd_out is None or bitwise_equal(bwd_out, train_gpt.relu2_backward_eager(grad_out, w_proj, pre)))
        )
        unlike_cublas = int((plain.view(torch.int16) != pre.view(torch.int16)).sum())
        fused = (
            lambda: relu2_matmul(x, w, PLAIN, config, sms),
            lambda: relu2_matmul(x, w, FORWARD, config, sms),
            None if config[5] else lambda: train_gpt.relu2_backward_matmul(grad_out, w_proj, pre, config[:5], sms),
        )
        # the card's clock moves within seconds: each pair is timed back to back, in both orders, and compared by
        # the median of the per-pair ratios
        parts = []
        for (kind, reference), candidate in zip(references, fused):
            if candidate is None:
                continue
            pairs = []
            for turn in range(args.pairs):
                first, second = (reference, candidate) if turn % 2 == 0 else (candidate, reference)
                t_first, t_second = ms_per_call(first), ms_per_call(second)
                pairs.append((t_first, t_second) if turn % 2 == 0 else (t_second, t_first))
            ref_ms = statistics.median(p[0] for p in pairs)
            fused_ms = statistics.median(p[1] for p in pairs)
            ratio = statistics.median(p[1] / p[0] for p in pairs)
            extra = f", {flops / fused_ms / 1e9:.0f} TFLOP/s" if kind == "plain" else ""
            parts.append(f"{kind} {fused_ms:.3f} vs {ref_ms:.3f} ms (x{ratio:.3f}{extra})")
        print(f"{name}: " + "; ".join(parts) + f"; epilogues bitwise the unfused formula (backward: with cuBLAS): {exact}; "
              f"product elements unlike cuBLAS's: {unlike_cublas} of {plain.numel()}", flush=True)


if __name__ == "__main__":
    main()
