"""Launch plumbing shared by every kernel of the wing: where kernels run, PDL, split-K buffers.

Every wrapper (the GEMM, the decoder's small ops, attention, LoRA, the sampler) asks these questions
before it launches, so they live apart from any one kernel family:

    interpreting()        do Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)? Then no
                          inline PTX can run and bf16 tl.dot is wrong (triton 3.9), so every kernel
                          takes its plain-tl / fp32-dot branch (an INTERPRET or FP32_DOT constexpr)
    capability(index)     the CUDA device's compute capability, cached
    num_sms(device)       streaming multiprocessors (4 on the CPU, so small tests still split)
    pdl_launch(device)    the launch keywords of programmatic dependent launch
    split_counts(...)     zeroed int32 counters for split-K sums done inside a launch
    partials(split, out)  where a split launch writes its fp32 partial sums

Programmatic dependent launch (Hopper and later). A kernel launched with launch_pdl=True may be
scheduled while the kernel before it in the stream is still running; it calls gdc_wait()
(griddepcontrol.wait: the previous grid has finished and its writes are visible) before it reads
anything an earlier kernel wrote. Results are unchanged; the launch latency and the prologue
(address math, loads of the constant weights) overlap the previous kernel's tail, which matters in
a decode step of hundreds of small kernels. Every kernel in such a chain must wait before reading: a
kernel that skipped the wait could overtake its predecessor. The device side is
fp4_decode.pdl_start (the register-A kernels issue the same two instructions themselves); the switch
is tuning.current().pdl, read at each launch.

When is the next kernel scheduled? Every kernel releases it right after its own wait, except the
CUDA-core GEMV that is not the gate/up one: it releases after its main loop (gemv.py). The paged
decode kernel comes right after the qkv GEMV; scheduled early, its programs would wait on the SMs
through the whole GEMV. A matmul that folds a LoRA update (GEMV, fragment kernel, swapped tiles, after
lora.lora_shrink) waits and releases after its main loop: the shrink runs beside the weight stream
instead of before it (fp4_decode.pdl_start says why that is safe). A kernel may also load, before
its wait, what the kernel just before it does not write (attention's first cache tile, RMSNorm's
weight and residual, the first loop step's weights of the GEMV and the fragment kernel): that
latency then passes under the previous kernel's tail.

Split-K summed in the launch: every split stores its fp32 partial tile and counts itself in an
int32 per output tile (fp4_decode._last_split); the split that counts last sums the partials in
order and sets the count back to zero. The counters are one buffer per CUDA stream, as torch keeps
cuBLAS workspaces: the launches of one stream run one after another, and two streams never share
counts.

Leaves out: autotuning (launch shapes are chosen in shapes.py from tuning.py's fields).
Test: through every kernel test (tests/test_kernels_*.py); the counters' contract in
test_kernels_small_m.py (test_in_kernel_split_reduce_equals_the_reduce_kernel).
"""
import functools
import os

import torch

from . import tuning

SPLIT_COUNTS = 1 << 16    # tiles one split launch may have (GEMV: N <= 2^20 rows; fragment: 2^22)
_SPLIT_COUNTS = {}        # (device, stream) -> int32 zeros, see split_counts


def interpreting() -> bool:
    """Do Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)?"""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def capability(index: int):
    return torch.cuda.get_device_capability(index)


def num_sms(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_launch(device) -> dict:
    """Launch keywords for a kernel that starts with pdl_start(USE_PDL): programmatic dependent
    launch where the device has it (Hopper and later, not under the interpreter) and tuning says so.
    A decode step asks ~500 times: the answer is kept per (device, setting, interpreter)."""
    return _pdl_keywords(device, tuning.current().pdl, interpreting())


@functools.lru_cache(maxsize=None)
def _pdl_keywords(device, pdl: bool, interp: bool) -> dict:
    on = pdl and device.type == "cuda" and not interp and capability(device.index or 0)[0] >= 9
    return dict(USE_PDL=on, launch_pdl=on)


NO_PDL = dict(USE_PDL=False, launch_pdl=False)


def split_counts(device, tiles):
    """SPLIT_COUNTS int32 zeros for a kernel's in-kernel split-K reduce (each launch leaves them
    zero). One buffer per CUDA stream; never replaced or freed, since captured CUDA graphs hold its
    address (the first use on a capture stream allocates it inside the capture: a memset node of
    that graph)."""
    if tiles > SPLIT_COUNTS:
        raise ValueError(f"a split launch of {tiles} tiles; the in-kernel reduce counts {SPLIT_COUNTS}")
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _SPLIT_COUNTS:
        _SPLIT_COUNTS[key] = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device)
    return _SPLIT_COUNTS[key]


def partials(split: int, out):
    """Where a split launch writes: fp32 partial sums (split, *out.shape), or out if split is 1."""
    return torch.empty((split, *out.shape), device=out.device, dtype=torch.float32) if split > 1 else out
