"""Tests for kernels/fp4_decode.py: the in-kernel E2M1 / E4M3 decoding is exact for every code and scale.

x = rows of the identity, so y = Wᵀ: every element must lie within one bf16 rounding of the float64
reference marlin_kernel.reference_dequantize (plain torch, e2m1 · scale / global_scale). Every byte
value and E4M3 scales from subnormal to 448, through each kernel that decodes: nvfp4_matmul (the
tile kernel at M = 32), the CUDA-core GEMV (gemm._gemv) and the fragment kernel (gemm._mma, both
token tiles). On the CPU (interpreter) this checks the plain-tl branches, on the GPU the PTX; the
tensor-core kernels' decode PTX is also run on the CPU, op by op, by a model of the PTX ISA's rules.
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


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def run_decode_ptx(lines, word):
    """The decode's PTX lines on one 32-bit word, in Python, by the PTX ISA's rules for the ops it
    uses (shl.b32, and.b32, prmt.b32 in its default mode: selector nibble i picks byte (n & 7) of
    {b, a} for the result's byte i, and with n & 8 replicates that byte's sign bit over it); an fma
    records its first operand, the bf16 pair before the scale multiply. Any other op fails."""
    regs, out = {"W": word}, {}
    for line in lines:
        op, rest = line.rstrip(";").split(" ", 1)
        args = [a.strip() for a in rest.split(",")]
        val = lambda a: regs[a] if a in regs else int(a, 0)  # noqa: E731
        if op == "shl.b32":
            regs[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "prmt.b32":
            a, b, sel = val(args[1]), val(args[2]), val(args[3])
            src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            result = 0
            for i in range(4):
                n = (sel >> 4 * i) & 0xF
                byte = src[n & 7]
                result |= ((0xFF if byte & 0x80 else 0) if n & 8 else byte) << 8 * i
            regs[args[0]] = result
        elif op == "fma.rn.bf16x2":
            out[args[0]] = val(args[1])
        else:
            raise AssertionError(f"the decode uses {op}, which this model of PTX does not know")
    return out


def test_decode_ptx_gives_e2m1_times_2_to_the_minus_126():
    """fp4_decode._e2m1x4_to_bf16_ptx (the tensor-core kernels' decode, which the CPU cannot run),
    interpreted op by op: every code in every nibble of a word (and random words) comes out as the
    bf16 bits of e2m1(code)·2^-126 (torch's float32 -> bfloat16 conversion, exact here), in the
    documented pairs (lo b0, lo b1), (lo b2, lo b3), (hi b0, hi b1), (hi b2, hi b3)."""
    from kernels.fp4_decode import _e2m1x4_to_bf16_ptx
    lines = _e2m1x4_to_bf16_ptx("W", "S01", "S23", "LO01", "LO23", "HI01", "HI23")
    table = torch.tensor([(-1.0 if c & 8 else 1.0) * E2M1[c & 7] * 2.0 ** -126 for c in range(16)])
    bits = table.bfloat16().view(torch.int16).int() & 0xFFFF                # expected lane per code
    gen = torch.Generator().manual_seed(0)
    words = [b * 0x01010101 for b in range(256)] + [b << 8 * i for b in range(256) for i in range(4)]
    words += torch.randint(0, 2 ** 31, (500,), generator=gen).tolist()
    words += [w | 0x80000000 for w in words[-250:]]
    for w in words:
        out = run_decode_ptx(lines, w)
        b = [(w >> 8 * i) & 0xFF for i in range(4)]
        for reg, (c0, c1) in {"LO01": (b[0] & 15, b[1] & 15), "LO23": (b[2] & 15, b[3] & 15),
                              "HI01": (b[0] >> 4, b[1] >> 4), "HI23": (b[2] >> 4, b[3] >> 4)}.items():
            assert out[reg] == bits[c0] | bits[c1] << 16, f"word {w:#010x}: {reg} {out[reg]:#010x}"


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
