"""Tests for kernels/fp4_decode.py: the in-kernel E2M1 / E4M3 decoding is exact for every code and scale.

x = rows of the identity, so y = Wᵀ: every element must lie within one bf16 rounding of the float64
reference marlin_kernel.reference_dequantize (plain torch, e2m1 · scale / global_scale). Every byte
value and E4M3 scales from subnormal to 448, through each kernel that decodes: nvfp4_matmul (the
tile kernel at M = 32), the CUDA-core GEMV (gemm._gemv) and the fragment kernel (gemm._mma, both
token tiles). On the CPU (interpreter) this checks the plain-tl branches, on the GPU the PTX.
"""
import pytest
import torch

import kernels
from kernels import gemm, shapes
from marlin_kernel import reference_dequantize
from nvfp4_cases import DEV


def test_every_code_and_scale_decodes_exactly():
    """x = identity gives y = Wᵀ: each element within one bf16 rounding of e2m1·scale/gs."""
    K = 32
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)           # every byte value
    packed = codes.repeat(1, K // 32)                                      # (16, K/2)
    scale = torch.tensor([2.0 ** -9, 2.0 ** -7, 0.375, 448.0]).repeat(16, 1)[:, :K // 16]
    scale = scale.to(torch.float8_e4m3fn)                                  # subnormal..max
    gs = torch.tensor([3.0])
    packed, scale, gs = packed.to(DEV), scale.to(DEV), gs.to(DEV)
    y = kernels.nvfp4_matmul(torch.eye(K, dtype=torch.bfloat16, device=DEV), packed, scale, gs)  # (K, 16)
    W = reference_dequantize(packed, scale, gs)                            # (16, K) float64
    err = (y.double().t() - W).abs()
    assert (err <= 2.0 ** -8 * W.abs()).all(), f"decode off by {err.max():.3e}"


def test_cuda_core_gemv_decodes_every_code_exactly():
    """x = the rows of the identity one at a time: y = Wᵀ within one bf16 rounding, code 1 (0.5,
    an fp32 subnormal inside the kernel) included."""
    K = 32
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(1, K // 32).to(DEV)
    scale = torch.tensor([2.0 ** -9, 2.0 ** -7, 0.375, 448.0]).repeat(16, 1)[:, :K // 16]
    scale, gs = scale.to(torch.float8_e4m3fn).to(DEV), torch.tensor([3.0], device=DEV)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    y = torch.cat([gemm._gemv(eye[k:k + 1], packed, scale, gs, None, shapes.GemvConfig()) for k in range(K)])
    W = reference_dequantize(packed, scale, gs)
    err = (y.double().t() - W).abs()
    assert (err <= 2.0 ** -8 * W.abs()).all(), f"decode off by {err.max():.3e}"


@pytest.mark.parametrize("M", [4, 13])
def test_fragment_kernel_decodes_every_code_exactly(M):
    """Rows of the identity M at a time: y = Wᵀ within one bf16 rounding for every byte value and
    E4M3 scales from subnormal to max (through both token tiles at M = 13)."""
    K = 128
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64).repeat(4, 1).to(DEV)     # (16, 64)
    scale = torch.tensor([2.0 ** -9, 2.0 ** -7, 0.375, 448.0, 1.0, 2.0 ** -6, 96.0, 0.0078125])
    scale, gs = scale.repeat(16, 1).to(torch.float8_e4m3fn).to(DEV), torch.tensor([3.0], device=DEV)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    y = torch.cat([gemm._mma(eye[k:k + M], packed, scale, gs, None, shapes.MmaConfig()) for k in range(0, K, M)])
    W = reference_dequantize(packed, scale, gs)
    err = (y.double().t() - W).abs()
    assert (err <= 2.0 ** -8 * W.abs()).all(), f"decode off by {err.max():.3e}"


WAIT_SCRIPT = """
import sys, time, torch, triton, triton.language as tl
from kernels.fp4_decode import SHRINK_READY, _await_shrink
@triton.jit
def wait(flag_ptr, R, SPINS: tl.constexpr):
    _await_shrink(flag_ptr, R, 16, tl.num_programs(0), SPINS)
spins = int(sys.argv[1])
flags = torch.zeros(128, dtype=torch.int32, device="cuda")
flags[SHRINK_READY.value] = 2                        # R = 32 ranks in tiles of 16: both counted ready
wait[(4,)](flags, 32, SPINS=spins)
torch.cuda.synchronize()
print("set: returned", flags[SHRINK_READY.value].item(), flags[SHRINK_READY.value + 1].item(), flush=True)
t = time.perf_counter()
wait[(4,)](flags, 32, SPINS=spins)                   # the last reader set the words back to 0: never ready
try:
    torch.cuda.synchronize()
    print("not trapped", flush=True)
except RuntimeError as e:
    print(f"trapped after {time.perf_counter() - t:.2f} s: {e}", flush=True)
"""


@pytest.mark.gpu
def test_gpu_a_carried_shrink_flag_that_never_comes_traps_instead_of_hanging(tmp_path):
    """_await_shrink, where the readers of a carried LoRA shrink wait: with the ready word counting
    every rank tile, the readers return and the last sets both words back to 0; on a word that no
    program sets, each reader stops after SPINS loads with a trap, and the host's next synchronisation
    raises a CUDA error instead of waiting forever. In a subprocess: a trap leaves the CUDA context
    unusable."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "wait.py"                                  # Triton compiles a kernel from its file
    script.write_text(WAIT_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(1 << 20)], cwd=root, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
    assert "set: returned 0 0" in out.stdout, out.stdout + out.stderr
    assert "trapped after" in out.stdout and "CUDA error" in out.stdout, out.stdout + out.stderr
