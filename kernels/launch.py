"""Launch plumbing shared by every kernel of the wing: where kernels run, PDL, split-K buffers.

Every wrapper (the GEMM, the decoder's small ops, attention, LoRA, the sampler) asks these questions
before it launches, so they live apart from any one kernel family:

    interpreting()        do Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)? Then no
                          inline PTX can run and bf16 tl.dot is wrong (triton 3.9), so every kernel
                          takes its plain-tl / fp32-dot branch (an INTERPRET or FP32_DOT constexpr)
    capability(index)     the CUDA device's compute capability, cached
    num_sms(device)       streaming multiprocessors (4 on the CPU, so small tests still split)
    pdl_launch(device)    the launch keywords of programmatic dependent launch
    counters(device)      the current stream's int32 counters (a Row), allocated once per device
    split_counts(...)     zeroed int32 counters for split-K sums done inside a launch
    shrink_flags(device)  zeroed int32 counters of a launch that carries a LoRA shrink (lora.py)
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
order and sets the count back to zero. The counters (these and a carried shrink's flags) are one row
per CUDA stream, as torch keeps cuBLAS workspaces: the launches of one stream run one after another,
and two streams never share counts. The rows are one buffer per device, allocated by the first
launch that counts, which runs eagerly (Triton cannot load a kernel's binary while a stream
captures), and never inside a CUDA-graph capture: a tensor allocated there lives in the graph's
memory pool, whose memory torch gives to other tensors, so counters kept there fill with other
tensors' values, a split's sum goes missing and a carried shrink's readers wait forever. A stream
first seen inside a capture takes the next row, already zero.

Leaves out: autotuning (launch shapes are chosen in shapes.py from tuning.py's fields).
Test: through every kernel test (tests/test_kernels_*.py); the counters' contract in
test_kernels_small_m.py (test_in_kernel_split_reduce_equals_the_reduce_kernel, and on a GPU
test_gpu_counters_live_outside_every_graph_pool).
"""
import dataclasses
import functools
import os

import torch

from . import tuning

SPLIT_COUNTS = 1 << 16    # tiles one split launch may have (GEMV: N <= 2^20 rows; fragment: 2^22)
SHRINK_SLOTS, SHRINK_FLAGS = 4, 128   # a carried shrink's counters: slots taken in turn, ints a slot
STREAMS = 64              # CUDA streams of one device that may count (a row each: 258 KiB)
_COUNTERS = {}            # device -> Counters, see counters


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


@dataclasses.dataclass
class Row:
    """One CUDA stream's counters, views of its row of the device's buffer: the split counts, the
    shrink flags' slots, and the slot the next carried shrink takes."""
    split: torch.Tensor                                    # (SPLIT_COUNTS,)
    slots: torch.Tensor                                    # (SHRINK_SLOTS, SHRINK_FLAGS)
    turn: int = 0


@dataclasses.dataclass
class Counters:
    """A device's int32 counters: one buffer, a Row of it for each CUDA stream that counts."""
    buffer: torch.Tensor                                   # (STREAMS, SPLIT_COUNTS + SHRINK_SLOTS * SHRINK_FLAGS)
    rows: dict = dataclasses.field(default_factory=dict)   # stream -> Row


def counters(device) -> Row:
    """The current stream's Row of its device's Counters (zeros where no launch is in flight). The
    first call on a device allocates them; under a CUDA-graph capture that is an error, not an
    allocation in the graph's pool (the module docstring says why)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernels: the first launch that counts on {device} is inside a CUDA-graph capture; "
                               f"run the step once eagerly first (its counters must not live in the graph's pool)")
        _COUNTERS[device] = Counters(torch.zeros(STREAMS, SPLIT_COUNTS + SHRINK_SLOTS * SHRINK_FLAGS,
                                                 dtype=torch.int32, device=device))
    c = _COUNTERS[device]
    if stream not in c.rows:
        if len(c.rows) == STREAMS:
            raise RuntimeError(f"kernels: more than {STREAMS} CUDA streams launch counting kernels on {device}")
        row = c.buffer[len(c.rows)]
        c.rows[stream] = Row(row[:SPLIT_COUNTS], row[SPLIT_COUNTS:].view(SHRINK_SLOTS, SHRINK_FLAGS))
    return c.rows[stream]


def split_counts(device, tiles):
    """SPLIT_COUNTS int32 zeros for a kernel's in-kernel split-K reduce (each launch leaves them
    zero): the current stream's (counters)."""
    if tiles > SPLIT_COUNTS:
        raise ValueError(f"a split launch of {tiles} tiles; the in-kernel reduce counts {SPLIT_COUNTS}")
    return counters(device).split


def shrink_flags(device):
    """The int32 counters of one launch that carries a LoRA shrink (fp4_decode._carried_shrink: its
    rank tiles' chunk counts, then ready and readers; each launch leaves them zero): the next of the
    current stream's SHRINK_SLOTS slots, in turn, since under PDL a launch's programs may still be on
    the SMs while the next launch's begin (never more than two launches: a launch is scheduled only
    once the kernel two places ahead has finished)."""
    row = counters(device)
    turn, row.turn = row.turn, (row.turn + 1) % SHRINK_SLOTS
    return row.slots[turn]


def partials(split: int, out):
    """Where a split launch writes: fp32 partial sums (split, *out.shape), or out if split is 1."""
    return torch.empty((split, *out.shape), device=out.device, dtype=torch.float32) if split > 1 else out
