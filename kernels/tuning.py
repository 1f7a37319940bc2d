"""Every route threshold and launch shape of the kernel wing, in one frozen dataclass.

The kernels' speed depends on choices that are data, not code: at how many rows of x the GEMM
switches kernels, how many programs a split launch makes, how many partitions the attention kernel
merges itself. They live here, each with the rule it encodes and why, so that a reader finds them in
one place and a benchmark varies them without touching a module:

    import dataclasses
    from kernels import tuning
    with tuning.using(dataclasses.replace(tuning.current(), pdl=False)):
        ...                                   # every launch in here runs without PDL

Code reads `current()` at call time (never at import), so `using` takes effect at once and is undone
on exit, even by an exception. bench/ab.py builds its variants this way (`field=value` on the
command line), tests use it to reach both sides of a route.

The defaults are what ships: the winners of same-run A/Bs on an H100 (bench/ab.py for the decode
graph, bench/kernel_ab.py for one matmul; the current numbers are in kernels/README.md). Hardware
facts (shared memory per SM) and kernel limits (the GEMV takes one row, the fragment kernel 16) are
constants of the modules that depend on them, not fields here: changing them would break a kernel,
not retune it.

Test: tests/test_kernels_tuning.py (using restores on exceptions; a replaced field moves the route
it names).
"""
import contextlib
from dataclasses import dataclass, field, fields

LORA_MAX_ROWS = 64   # the LoRA kernels' largest row tile (lora.py holds every row of x in one)

# ----------------------------------------------------------------------------------------------
# the tile kernels' launch shape: the type of `medium` below (shapes.py holds the other kernels')

@dataclass(frozen=True)
class TileConfig:
    """One tile-kernel launch. bm/bn/bk: tile sizes along M, N, K; split: programs along the
    reduction dim (0 = choose from the problem size); group: tiles swept together for L2 reuse; swap:
    the forward computes (W·xᵀ)ᵀ with W from registers (small M) instead of x·Wᵀ (medium M)."""
    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 4
    split: int = 0
    group: int = 8
    swap: bool = True

    def __post_init__(self):
        for field in ("bm", "bn", "bk"):
            v = getattr(self, field)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{field} must be a power of two >= 16, got {v}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if self.stages < 1 or self.split < 0 or self.group < 1:
            raise ValueError(f"TileConfig: stages >= 1, split >= 0, group >= 1 needed, got {self}")


# ----------------------------------------------------------------------------------------------
# the settings

@dataclass(frozen=True)
class Tuning:
    # ---- launch plumbing
    pdl: bool = True                  # programmatic dependent launch on sm_90: a kernel's launch and prologue
                                      # overlap the previous kernel's tail (bench/rollout.py's -nopdl turns it off)
    fused: bool = True                # the rollout path takes the wing's kernels for norms, RoPE, attention,
                                      # LoRA and sampling (bench/rollout.py's -unfused runs torch ops instead)
    compile_min_numel: int = 1 << 24  # the training pass compiles its norm / RoPE / SiLU·mul (compiled.py) where
                                      # x has this many elements: below, a compiled call's fixed host cost
                                      # exceeds what fusion saves (SmolLM2's ~3M-element micro-batches ran
                                      # slower compiled, 7B's ~34M faster; bench/step.py's -eager arms: never)
    reduce_in_kernel: bool = True     # a split-K launch that can sum its own partials does (its last split):
                                      # one launch less; tests turn it off to compare with the reduce kernel

    # ---- y = x·Wᵀ: which kernel runs at M rows (gemm.route)
    dequant_min_m: int = 512          # from this M: W dequantized once, then cuBLAS (compute-bound; the fused
                                      # tiles reach under half of cuBLAS there)
    dequant_narrow_min_m: int = 128   # ... from this M on narrow weights, whose fused launch has few tiles
    narrow_weight: int = 20_000_000   # a narrow weight has at most this many elements (7B qkv, o)
    wide_n: int = 16384               # a wide weight (gate_up) has at least this many rows
    wgmma_min_m: int = 16             # the register-A kernel above this M (where it can run) ...
    wgmma_small_min_m: int = 1        # ... above this M on big weights that are not wide (down, 14B / 32B qkv
                                      # and o), and above the GEMV's row on wide ones: it beats the fragment
                                      # kernel there (kernels/README.md has the A/B)
    wgmma_max_m: int = 1024           # ... up to this M (dequantize + cuBLAS beyond)
    wgmma_narrow_max_m: int = 128     # ... on narrow weights to this M; between it and wgmma_fill_m
                                      # dequantize + cuBLAS wins
    wgmma_fill_m: int = 512           # above this M only where its launch fills its waves ...
    wave_fill: float = 0.6            # ... to this share (a part-empty last wave costs a whole one)
    gemv_tma_weight: int = 100_000_000  # at one row, weights with more elements (gate_up; 32B down) take the
                                      # TMA-fed GEMV (gemv_tma.py); on smaller ones (7B / 14B down, q/k/v, o)
                                      # gemv.py's lighter programs start sooner
    fragment_reduce_max_m: int = 4    # a split fragment launch sums its own partials to this M ...
    pair_reduce_max_m: int = 8        # ... and to this M where a step loads two windows; else the reduce kernel

    # ---- dx = dy·W: which kernel runs at M rows
    dx_wgmma_min_m: int = 64          # the register-A kernel on Wᵀ above this M, on big weights ...
    dx_wgmma_full_m: int = 256        # ... to this M; above it dequantize + cuBLAS on big weights, except ...
    dx_wgmma_max_m: int = 512         # ... to this M on the widest weights (dx_wide) ...
    dx_wave_fill: float = 0.8         # ... where its programs fill their waves to this share
    dx_wide: int = 64_000_000         # the widest weights (gate_up, down) have more elements than this

    # ---- launch shapes of the GEMM kernels (shapes.py)
    gemv_tma_steps: int = 8           # a split of the TMA-fed GEMV streams at least this many 512-k steps:
                                      # its ring fills once a program, so short programs pay its latency often
    gemv_wave: int = 5                # programs an SM that a CUDA-core GEMV split of 1024-k steps (the 32B
                                      # weights) fills, not ~8
    pair_windows: int = 4             # fragment programs of at most this many 128-k windows (twice that at
                                      # M <= 4) load two windows a step: short runs are chains of load latency
    long_run_windows: int = 12        # at M = 5..8 a fragment program of at least this many windows ...
    long_run_cut: int = 8             # ... is cut into runs of this many, two windows a step
    ahead_min_m: int = 5              # from this M to ahead_max_m a fragment program loads its next step
    ahead_max_m: int = 8              # before it decodes this one (a step in flight while it decodes one):
                                      # it pays at 8 rows, not at 2-4 or 9-16 (shapes.mma_ahead)
    wgmma_decode_wave: float = 0.75   # register-A split-K at <= 16 tokens fills this share of a wave: each
                                      # split adds fp32 partials that the reduce kernel reads back
    long_ring_windows: int = 32       # one-wave register-A programs of at least this many windows take a
                                      # 4-stage ring where it costs no programs an SM
    ws_min_bt: int = 64               # from this many tokens a program the register-A kernel is the
                                      # warp-specialized one (below, its producer warp halves the programs an SM)
    tail_bt: int = 64                 # tokens a program in the small tiles of a part-empty last wave ...
    tail_min_windows: int = 32        # ... unless its rows split along K into pieces of at least this many windows
    medium: TileConfig = field(default=TileConfig(bm=128, bn=128, bk=64, warps=8, stages=4, swap=False))
                                      # 64 < M < dequantize: x·Wᵀ with W decoded once into shared memory

    # ---- LoRA on the rollout path (lora.py)
    lora_max_m: int = 32              # to this many rows (at most LORA_MAX_ROWS) the shrink / expand kernels
                                      # do the update; beyond, F.linear and an addmm (or the reduce kernel)
    lora_rank_rows: int = 16          # rank rows of A a shrink program takes (one MMA tile) ...
    lora_shrink_k: int = 256          # ... and k, in one load before its PDL wait: K / this many programs a
                                      # row tile stream A at once, and its last one sums their partials
    lora_expand_cols: int = 64        # output columns an expand program updates
    reduce_lora_cols: int = 32        # output columns a program of the split-K reduce that adds the update at
                                      # decode takes: its tail (the wait for h, then h·Bᵀ) is a chain of latencies,
                                      # so more, narrower programs finish sooner (128 and 64 slower at 8-32 rows,
                                      # 16 at 16); the GRPO batch's reduce keeps 128
    norm_shrink_max_m: int = 1        # to this many rows the RMSNorm before an adapted group (q/k/v, gate/up)
                                      # runs the group's shrink in its own launch (lora.norm_shrink): at 8
                                      # rows its rows x ranks programs, waiting beside the matmul, cost more
    norm_shrink_ranks: int = 1        # ... each program taking one whole row and this many rank rows
    row_shrink_max_m: int = 1         # to this many rows the other shrinks (o, down) take whole rows too
                                      # (lora.row_shrink): no partials for a last program to sum
    carry_shrink: bool = True         # from there to lora_max_m rows, where a launch after the matmul adds
                                      # the update (the reduce or expand kernel), it computes the shrink in
                                      # its first programs: a launch between x's producer and the matmul
                                      # keeps the matmul off the SMs until the producer is done (lora.py)
    lora_b_prefetch: bool = True      # the one-row GEMVs that fold the update ask L2 for their rows of B before
                                      # the main loop (gemv._prefetch_lora_b): the epilogue's read of them is shorter

    # ---- the decoder's small ops (fused_ops.py)
    lm_head_max_rows: int = 2         # the lm_head GEMV to this many rows (at 3-4 the per-row accumulators
                                      # cost more than they save; cuBLAS beyond)
    lm_head_tiles: tuple = ((8, 512), (8, 256))  # its (weight rows, k a step) at 1 and 2 rows

    # ---- paged decode attention (paged_decode.py)
    partition_tokens: int = 16        # the context splits into partitions of this many positions per row of
                                      # the batch (16..512, at least max_model_len / 64): batch 1 fills the GPU,
                                      # and at 8 rows more, shorter programs keep more K/V loads in flight ...
    attention_tile: int = 64          # ... as do 64 positions a loop step (a power of two, >= a cache block) ...
    attention_stages: int = 2         # ... at a software pipeline depth of 2 (num_stages): 32 / 128 / 3 read
                                      # K/V slower at 8 rows over long contexts (kernels/README.md has the A/B)
    merge_max_parts: int = 8          # up to this many partitions the attention kernel merges them itself (its
                                      # last program per row and head); more: the merge kernel, one program a head
    merge_chunk: int = 8              # partitions the in-kernel merge reads a pass
    early_max_tile: int = 64          # the first K/V tile loads before the PDL wait up to this many positions
                                      # (a bigger tile holds too many registers through q's loads)

    # ---- sampling (sampler.py)
    sample_chunk: int = 4096          # logits a program when greedy
    sample_chunk_small: int = 1024    # ... when drawing at <= sample_small_rows rows (a Philox draw per logit
    sample_chunk_large: int = 2048    # makes programs longer, so they take fewer) and beyond
    sample_small_rows: int = 16

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if v < 0:
                raise ValueError(f"Tuning.{f.name} must be >= 0, got {v!r}")
            if f.name in ("wave_fill", "dx_wave_fill", "wgmma_decode_wave") and v > 1:
                raise ValueError(f"Tuning.{f.name} is a share of a wave, in [0, 1], got {v!r}")
        if self.lora_max_m > LORA_MAX_ROWS:
            raise ValueError(f"Tuning.lora_max_m: the LoRA kernels hold every row in one tile of at most "
                             f"{LORA_MAX_ROWS}, got {self.lora_max_m}")
        for name in ("lora_rank_rows", "lora_shrink_k", "lora_expand_cols", "reduce_lora_cols"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tuning.{name}: a tile side, a power of two >= 16, got {v}")
        if self.norm_shrink_ranks < 1 or self.norm_shrink_ranks & (self.norm_shrink_ranks - 1):
            raise ValueError(f"Tuning.norm_shrink_ranks: a power of two, got {self.norm_shrink_ranks}")
        if self.lm_head_max_rows > len(self.lm_head_tiles) or self.lm_head_max_rows > 2:
            raise ValueError(f"Tuning.lm_head_max_rows: the lm_head GEMV takes 1 or 2 rows, one tile each, "
                             f"got {self.lm_head_max_rows} with {len(self.lm_head_tiles)} tiles")


# ----------------------------------------------------------------------------------------------
# the active Tuning

_active = [Tuning()]          # one slot: the Tuning every call reads now


def current() -> Tuning:
    """The Tuning in effect (the defaults unless inside `using`)."""
    return _active[0]


@contextlib.contextmanager
def using(t: Tuning):
    """Make t current inside the block; the previous one comes back on exit, also on an exception."""
    if not isinstance(t, Tuning):
        raise TypeError(f"using() takes a kernels.tuning.Tuning, got {type(t).__name__}")
    previous = _active[0]
    _active[0] = t
    try:
        yield t
    finally:
        _active[0] = previous
