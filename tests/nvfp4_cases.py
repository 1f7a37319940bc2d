"""Shared helpers of the NVFP4 matmul tests: random weights, error measures, the forward check and a
launch recorder.

Used by tests/test_marlin_kernel.py (the teaching kernel) and tests/test_kernels_*.py (the fast
kernels). Every check compares against marlin_kernel.reference_matmul / reference_dequantize, the
float64 reference written in plain torch (itself checked against nvfp4.dequantize), on fresh random
codes (all 16 E2M1 values) and scales (E4M3 from subnormal to large).

    DEV            "cuda" where a GPU is present, else "cpu" (the kernels then run in the Triton
                   interpreter: conftest sets TRITON_INTERPRET=1)
    SMALL          (M, N, K) cases that reach every route at interpreter-sized shapes
    random_weight  (packed, scale, global_scale) of an (N, K) weight
    rel_err, assert_close, check_forward   the error measures and the float64 forward check
    check_silu_mul a GEMV's SiLU·mul output against its plain launch and float64
    LaunchSpy      stands in for a Triton kernel and records which one a wrapper launched
"""
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# odd M, N at its minimum, K not a multiple of 64 or 128, several token tiles
SMALL = [(1, 16, 16), (3, 32, 64), (5, 48, 80), (17, 64, 32), (2, 16, 272), (4, 128, 320)]


def random_weight(N, K, gen, device=DEV):
    """(packed (N, K/2) u8, scale (N, K/16) e4m3 from 2^-12 to 2^8 incl. subnormals, global_scale (1,) f32)."""
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen).to(device)
    s = torch.exp2(torch.rand(N, K // 16, generator=gen) * 20 - 12)       # 2^-12 .. 2^8
    scale = s.to(torch.float8_e4m3fn).to(device)                          # incl. E4M3 subnormals
    global_scale = torch.tensor([448.0 * 6 / (0.5 + torch.rand(1, generator=gen).item())], device=device)
    return packed, scale, global_scale


def rel_err(out, ref):
    """Relative Frobenius error of out against the float64 ref."""
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_close(out, ref, what, worst=1e-2):
    """out finite (every element written) and within `worst` relative error of ref; -> the error."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output (an element was not written?)"
    e = rel_err(out, ref)
    assert e < worst, f"{what}: relative error {e:.2e} (max abs err {(out.double() - ref).abs().max():.3e})"
    return e


def check_forward(run, M, N, K, has_bias, seed, what):
    """run(x, packed, scale, global_scale, bias) on fresh random data against float64: shape, dtype,
    every element written (poisoned buffers), worst error < 1e-2 and typical < 4e-3 (bf16 output
    rounding is ~1.5e-3)."""
    import marlin_kernel
    gen = torch.Generator().manual_seed(seed)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    y = run(x, packed, scale, gs, bias)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    e = assert_close(y, marlin_kernel.reference_matmul(x, packed, scale, gs, bias), what)
    assert e < 4e-3, f"{what}: typical error too large: {e:.2e}"


def check_silu_mul(got, y, x, packed, scale, gs, lora, what):
    """got: a GEMV's silu_mul output (1, I) for W stacking gate and up (N = 2I); y: the same GEMV's
    plain output (1, N). got has the bits of fused_ops.silu_mul on y's two halves, and is within bf16
    tolerance of float64 silu(g)·u, the LoRA update lora (a gemm.Fold) added first (hp summed over its
    splits and rounded to bf16, as the kernels fold it)."""
    import marlin_kernel
    from kernels import fused_ops
    I = y.shape[1] // 2
    assert got.shape == (1, I) and torch.equal(got, fused_ops.silu_mul(y[:, :I], y[:, I:]))
    ref = marlin_kernel.reference_matmul(x, packed, scale, gs, None)
    if lora is not None:
        hp, B, s = lora[:3]
        ref = ref + s * hp.sum(0).bfloat16().double() @ block_diagonal(B, getattr(lora, "cuts", None), hp.shape[-1]).double().t()
    assert_close(got, torch.nn.functional.silu(ref[:, :I]) * ref[:, I:], what)


def block_diagonal(B, cuts, R):
    """A group's compact B (N, R / parts) laid out as the block-diagonal (N, R) it stands for: the rows
    before cuts[0] in ranks [0, RB), those before cuts[1] in [RB, 2RB), the rest in [2RB, 3RB)."""
    N, RB = B.shape
    ends = [0, *(cuts or ()), N]
    full = torch.zeros(N, R, dtype=B.dtype, device=B.device)
    for p, (n0, n1) in enumerate(zip(ends, ends[1:])):
        if n1 > n0:
            full[n0:n1, p * RB:(p + 1) * RB] = B[n0:n1]
    return full


class LaunchSpy:
    """Stands in for a Triton kernel: records (kernel, launch keyword arguments), then launches.
    Install it with monkeypatch under the name the wrapper launches (e.g. kernels.gemm._nvfp4_gemv_kernel)."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((self.kernel, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch
