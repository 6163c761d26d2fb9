"""The MLP's fused matmuls (train_gpt.relu2_forward_matmul and relu2_backward_matmul, and with quack-kernels
installed train_gpt.quack_relu2_forward_matmul and quack_relu2_backward_matmul) against cuBLAS + inductor's
pointwise kernels. One GPU.

At a record micro-step (49,152 tokens, 768 -> 3,072, bf16) the MLP forward computes pre = x @ W_fc and then
h = relu(pre)^2; its backward computes grad_h = grad_out @ W_proj and then the pointwise ReLU² backward over grad_h
(`grad_h * 2 relu(pre)` where `pre > 0`, else 0). train_gpt.py runs each in one persistent Triton matmul whose
epilogue applies the formula, so pre is not read back and grad_h never reaches memory. This times, per tile
configuration and direction, that kernel against cuBLAS + the compiled pointwise formula, as the median ratio over
pairs timed back to back in alternating orders (the card's clock moves within seconds), and checks that the kernel's
outputs are bitwise cuBLAS's product followed by the unfused formula. The same for the epilogues on quack-kernels'
GEMMs (--mlp_kernel=quack), last. The measurements that chose train_gpt.py's tile are in bench/NOTES.md
(2026-12-02, 2026-12-06); those of the quack kernel, 2026-12-07.

    python bench/bench_relu2_matmul.py        # one GPU (Hopper or newer, for TMA descriptors), one to two minutes
    python bench/bench_relu2_matmul.py --tiles 1    # train_gpt.py's tile and quack only
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

CALLS_PER_TIMING = 5  # back to back, so each launch's host work (descriptors, allocation) hides behind the last

try:
    import triton
except ImportError:  # CPU-only installs: main() refuses
    triton = None

TOKENS, DIM, HIDDEN = 49152, 768, 3072
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
CONFIGS = (
    train_gpt.RELU2_MATMUL_TILE,
    (128, 256, 64, 3, 8),
    (256, 128, 64, 3, 8),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 4, 8),
    (64, 256, 64, 4, 4),
)


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
    parser.add_argument("--pairs", type=int, default=4, help="reference/fused pairs per configuration, orders alternating")
    parser.add_argument("--tiles", type=int, default=len(CONFIGS), choices=range(1, len(CONFIGS) + 1),
                        help="time the first N Triton tiles (the first is train_gpt.py's)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or triton is None or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("bench_relu2_matmul.py: needs a CUDA GPU with TMA (compute capability 9.0 or newer) and Triton.")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = F.rms_norm(torch.randn(TOKENS, DIM, device="cuda"), (DIM,)).bfloat16()
    w_fc = (torch.randn(DIM, HIDDEN, device="cuda") * DIM**-0.5).bfloat16()
    grad_out = torch.randn(TOKENS, DIM, device="cuda").bfloat16()
    w_proj = (torch.randn(DIM, HIDDEN, device="cuda") * 0.02).bfloat16()
    pre = x @ w_fc
    forward_compiled = torch.compile(train_gpt.relu2_forward_eager, fullgraph=True)
    backward_compiled = torch.compile(train_gpt.relu2_backward_eager, fullgraph=True)
    def kernels(config: tuple[int, ...] | str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """train_gpt's (forward, backward) for a Triton tile, or for "quack" its quack kernel (RELU2_MATMULS)."""
        if config == "quack":
            return train_gpt.RELU2_MATMULS["quack"]
        return (functools.partial(train_gpt.relu2_forward_matmul, tile=config, programs=sms),
                functools.partial(train_gpt.relu2_backward_matmul, tile=config, programs=sms))

    directions = {  # name: (fused(config), reference, expected outputs)
        "forward": (lambda config: kernels(config)[0](x, w_fc), lambda: forward_compiled(x, w_fc), train_gpt.relu2_forward_eager(x, w_fc)),
        "backward": (lambda config: (kernels(config)[1](grad_out, w_proj, pre),), lambda: backward_compiled(grad_out, w_proj, pre),
                     (train_gpt.relu2_backward_eager(grad_out, w_proj, pre),)),
    }
    configs: list[tuple[int, ...] | str] = list(CONFIGS[: args.tiles])
    if train_gpt.quack_version() is not None:
        capability = torch.cuda.get_device_capability()
        train_gpt.check_kernel_package(train_gpt.QUACK_KERNELS, x.device, capability, "quack")  # one line if it does not import
        configs.append("quack")
    else:
        print("quack-kernels is not installed: its kernel is left out")
    flops = 2 * TOKENS * DIM * HIDDEN
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {sms} SMs; "
          f"{TOKENS} x {DIM} @ {DIM} x {HIDDEN} bf16, {args.repeats} calls per median")

    def ms_per_call(fn) -> float:
        return median_ms(lambda: [fn() for _ in range(CALLS_PER_TIMING)], args.repeats) / CALLS_PER_TIMING

    for config, (direction, (run_fused, reference, expected)) in itertools.product(configs, directions.items()):
        name = f"{direction} quack" if config == "quack" else "{} {}x{}x{} s{} w{}".format(direction, *config)
        fused = lambda: run_fused(config)  # noqa: E731
        try:
            out = fused()
        except (triton.CompilationError, triton.runtime.errors.OutOfResources, RuntimeError) as error:
            # what Triton raises for a configuration it cannot build or fit (its MLIR passes fail as RuntimeError);
            # a CUDA error is not that, and would leave every later configuration on a broken context
            if isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error):
                raise
            print(f"{name}: not built: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        pairs = []
        for turn in range(args.pairs):
            first, second = (reference, fused) if turn % 2 == 0 else (fused, reference)
            t_first, t_second = ms_per_call(first), ms_per_call(second)
            pairs.append((t_first, t_second) if turn % 2 == 0 else (t_second, t_first))
        ref_ms = statistics.median(p[0] for p in pairs)
        fused_ms = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[1] / p[0] for p in pairs)
        print(f"{name}: fused {fused_ms:.3f} vs cuBLAS + compiled formula {ref_ms:.3f} ms (x{ratio:.3f}, "
              f"{flops / fused_ms / 1e9:.0f} TFLOP/s); bitwise cuBLAS + the formula: {all(map(bitwise_equal, out, expected))}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except train_gpt.UserError as error:  # quack-kernels installed but not importable
        raise SystemExit(f"bench_relu2_matmul.py: {error}") from None
