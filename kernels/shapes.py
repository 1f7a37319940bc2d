"""Launch shapes of the FP4 x BF16 kernels: tile sizes, splits along K, ring stages, waves.

A launch shape is a small frozen dataclass per kernel family, and the functions here turn one and
a problem (M rows of x, an (N, K) weight, a device) into a grid:

    GemvConfig    the CUDA-core GEMV (one row of x)        bn rows a program, bk k a step, split
    MmaConfig     the mma.sync fragment kernel (M <= 16)   16·warps·tiles rows a program, split, windows
    TileConfig    the tile kernels (wgmma via tl.dot)      bm x bn x bk tiles, swapped (W·xᵀ) or not
                  (in tuning.py, whose `medium` field is one: tuning imports nothing of the wing)
    WgmmaConfig   the register-A wgmma kernel (sm_90)      bt tokens x bn rows a program, ring stages

Split-K. Decode products are memory-bound and have few output tiles, so a launch splits the
reduction among programs until the SMs have enough of them (`split`: double until tiles·split
reaches the target or a chunk would fall under min_blocks steps); each split writes fp32 partial
sums that are added in split order afterwards (by the last split itself or by the reduce kernel),
so the result is deterministic. The targets differ by kernel: ~8 GEMV programs an SM (their warps
wait on loads), or exactly one wave of them where a step is 1024 k (gemv_split); ~4 fragment or
swapped-tile programs an SM; one wave, or a share of one at decode, of register-A programs, whose
count an SM is set by shared memory (the ring) and registers (wgmma_wave).

Waves. A launch of more programs than fit on the GPU at once runs in waves; a part-empty last wave
costs as long as a full one. So the register-A launch may take fewer ring stages to fit one wave
(fit_stages), a deeper ring where that costs no programs an SM (deeper_ring), or give the rows of a
part-empty wave to a second launch (wgmma_launches: smaller tiles, or pieces along K that sum
themselves).

The thresholds come from tuning.current() at call time; the constants below are facts of the
hardware or of a kernel. Everything here is plain Python (no Triton), so the arithmetic can be
checked anywhere: tests/test_kernels_shapes.py counts the launches of the real projection shapes on
a pretend 132-SM H100 by hand.
"""
from dataclasses import dataclass, replace

from . import launch, tuning
from .tuning import TileConfig

# ----------------------------------------------------------------------------------------------
# constants: hardware and kernel facts

MIN_RED = 64              # reduction tiles are >= 64 wide (16-wide ones decoded wrong on the H100);
                          # a reduction dim that is not a multiple of 64 is zero-padded
GEMV_ROWS = 1             # the CUDA-core GEMV takes one row of x
FRAGMENT_MAX_M = 16       # the fragment kernel takes up to two token tiles of 8
SMEM_PER_SM = 228 * 1024  # H100 shared memory per SM (1 KB of it reserved per program)
MAX_REGS = {4: 128, 8: 168}   # maxnreg of the warp-specialized register-A kernel by consumer warps:
                              # (warps + 4) warps at this many registers, 2 programs an SM (4) or 1 (8)
DX_BT, DX_BK = 128, 256   # the register-A dx kernel's tile: tokens, output columns k (register_a_dx.py)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


# ----------------------------------------------------------------------------------------------
# the launch-shape dataclasses

@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the CUDA-core kernel (one row of x). bn: weight rows per program; bk: k per
    loop step (bk/2 bytes of each row, 16 a lane: bk/32 lanes, so a thread holds bn·bk/(1024·warps)
    rows of its lane); split: programs along K (0 = choose: gemv_split)."""
    bn: int = 32
    bk: int = 1024
    warps: int = 4
    stages: int = 1
    split: int = 0

    def __post_init__(self):
        if self.bn < 1 or self.bn & (self.bn - 1) or self.bk < 32 or self.bk & (self.bk - 1):
            raise ValueError(f"GemvConfig.bn/bk must be powers of two (bk >= 32), got {self}")
        if self.warps not in (1, 2, 4, 8, 16) or self.bn % self.warps or self.stages < 1 or self.split < 0:
            raise ValueError(f"GemvConfig: warps in 1..16 (power of two) dividing bn, stages >= 1, "
                             f"split >= 0, got {self}")


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of the fragment kernel (M <= 16, K a multiple of 128). tiles: 16-row tiles per
    warp (a program owns 16·warps·tiles rows); split: programs along K (0 = choose: mma_launch);
    windows: 128-k windows a loop step loads before it decodes any (0 = choose with the split; 1
    where split is given)."""
    warps: int = 4
    tiles: int = 1
    split: int = 0
    windows: int = 0

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8) or self.tiles not in (1, 2, 4, 8) or self.split < 0 \
                or self.windows not in (0, 1, 2, 4):
            raise ValueError(f"MmaConfig: warps and tiles in 1, 2, 4, 8, split >= 0, windows in 0, 1, 2, 4, "
                             f"got {self}")


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch shape of the register-A wgmma kernel (register_a.py). bt: tokens per program (wgmma's
    N: 8 .. 256, a power of two); bn: weight rows per program (64 per warpgroup of 4 warps; the
    warp-specialized kernel runs 8 warps as two consumer warpgroups of bn/2 rows each); stages: the
    ring (the launch may take fewer or more: fit_stages, deeper_ring); split: programs along K (0 =
    choose: wgmma_split)."""
    bt: int
    bn: int = 64
    warps: int = 4
    stages: int = 3
    split: int = 0

    def __post_init__(self):
        if self.bt not in (8, 16, 32, 64, 128, 256) or self.warps not in (4, 8) or self.bn % (16 * self.warps) \
                or self.bn & (self.bn - 1) or self.stages < 2 or self.split < 0 or (self.bt == 256 and self.warps < 8) \
                or (warp_specialized(self) and self.bn != 16 * self.warps):
            raise ValueError(f"WgmmaConfig: bt in 8..256 (power of two; 256 takes 8 warps: 128 accumulators a "
                             f"thread), 4 or 8 warps, bn a power-of-two multiple of 16·warps (from bt = "
                             f"{tuning.current().ws_min_bt}, warp-specialized: 64 rows a warpgroup), stages >= 2, "
                             f"split >= 0, got {self}")


def warp_specialized(cfg: WgmmaConfig) -> bool:
    """Does the register-A launch cfg run the warp-specialized kernel (register_a._wgmma_ws_kernel),
    or the cp.async ring kernel? By tokens a program: tuning's ws_min_bt and up."""
    return cfg.bt >= tuning.current().ws_min_bt


def tail_config() -> WgmmaConfig:
    """The small tiles that take the rows of a part-empty last wave (wgmma_launches)."""
    return WgmmaConfig(bt=tuning.current().tail_bt)


def ring_bytes(BN: int, BT: int, S: int) -> int:
    """Shared memory of the register-A kernel's ring: S stages of a BT x 128 bf16 x tile, BN x 16
    int32 words, BN x 8 scale bytes and two 8-byte mbarriers."""
    return S * (BT * 128 * 2 + BN * 16 * 4 + BN * 8 + 16)


# ----------------------------------------------------------------------------------------------
# the shape of each route

def fragment_rows(M: int, K: int) -> bool:
    """Can the fragment kernel compute y at M rows (above the GEMV's row, K a multiple of 128)?"""
    return GEMV_ROWS < M <= FRAGMENT_MAX_M and K % 128 == 0


def fwd_config(M: int, N: int, K: int):
    """Launch shape for y = x·Wᵀ on the GEMV, fragment and tile routes (the H100 sweep winners)."""
    if M <= GEMV_ROWS:           # 4 rows a thread at 512-k steps (72 registers), 8 at 1024-k steps
        # (x's prep amortized, 132 registers); 512 k (256 B of each row) where K is not a multiple of
        # 1024 (7B: 3584, 18944), so that no step runs half masked (1024-k steps or bn = 64 measured
        # slower there: kernels/README.md)
        return GemvConfig(bn=32, bk=1024 if K % 1024 == 0 else 512)
    if fragment_rows(M, K):      # mma.sync on fragments decoded in registers
        # 128 weight rows per program for the wide weights (gate_up: 8 warps, or 4 warps of two
        # tiles when each warp also runs two token tiles) and at M <= 4; else 64
        wide = N >= tuning.current().wide_n
        if M <= 4 or (wide and M <= 8):
            return MmaConfig(warps=8)
        return MmaConfig(tiles=2) if wide else MmaConfig()
    if M <= 16:
        return TileConfig(bm=16, bn=64, bk=128, warps=4, stages=4)
    if M <= 32:
        return TileConfig(bm=32, bn=64, bk=128, warps=4, stages=4)
    if M <= 64:
        return TileConfig(bm=64, bn=128, bk=128, warps=8, stages=3)
    return tuning.current().medium


def wgmma_config(M: int) -> WgmmaConfig:
    """Launch shape of the register-A kernel: 64 weight rows, 4 warps, 3 stages, tokens a program by
    M; at M <= 16 8 or 16 tokens and 4 stages; above 128 256 tokens and 128 rows, two consumer
    warpgroups (the decode is paid once per 256 tokens)."""
    if M <= 16:
        return WgmmaConfig(bt=8 if M <= 8 else 16, stages=4)
    if M > 128:
        return WgmmaConfig(bt=256, bn=128, warps=8)
    return WgmmaConfig(bt=32 if M <= 32 else 64 if M <= 64 else 128)


def dx_config(M: int, N: int, K: int) -> TileConfig:
    """Launch shape of the tile kernel for dx = dy·W (the H100 sweep winners)."""
    if M <= 64:
        return TileConfig(bm=max(16, next_power_of_2(M)), bn=64, bk=128, warps=4, stages=4)
    return TileConfig(bm=128, bn=64, bk=128, warps=8, stages=4)


# ----------------------------------------------------------------------------------------------
# splits

def fit(block: int, n: int) -> int:
    """The largest power of two <= block that divides n (n is a multiple of 16): no tail tiles."""
    while n % block:
        block //= 2
    return block


def split(split: int, tiles: int, red: int, block: int, programs: int, min_blocks: int = 4):
    """(split, chunk): programs along a reduction of length red, each reducing chunk (a multiple of
    block). split = 0 chooses: double it until tiles·split >= programs or chunks would get under
    min_blocks blocks."""
    if not split:
        split = 1
        while tiles * split < programs and red >= block * split * min_blocks:
            split *= 2
    chunk = cdiv(cdiv(red, split), block) * block
    return cdiv(red, chunk), chunk


def gemv_split(cfg: GemvConfig, tiles: int, K: int, bk: int, silu_mul: bool, sms: int):
    """(split, k per split) of a CUDA-core GEMV launch of tiles programs along N. ~8 programs an SM
    of >= 2 steps on average: the warps of a GEMV mostly wait on their loads, so more of them in
    flight. Where a step is 1024 k (K a multiple of 1024: the 32B weights), as many splits as fill
    one wave of gemv_wave programs an SM instead, but not more than half the steps (the 7B weights'
    512-k steps keep the first rule). SiLU·mul needs whole rows: no split."""
    if silu_mul or cfg.split or bk < 1024:
        return split(1 if silu_mul else cfg.split, tiles, K, bk, 8 * sms, min_blocks=2)
    n = min(tuning.current().gemv_wave * sms // tiles, cdiv(cdiv(K, bk), 2))
    return split(max(n, 1), tiles, K, bk, 0)


def gemv_tma_split(tiles: int, K: int, sms: int):
    """(split, 512-k steps a split) of a TMA-fed GEMV launch (gemv_tma.py) of tiles programs along
    N: each split at least gemv_tma_steps steps, and at most a wave of 8 programs an SM (the most its
    48 registers allow) in all. 7B down (112 tiles, 37 steps) takes 4 splits of 10 steps; gate_up,
    more than a wave of tiles, none."""
    n = max(1, min(cdiv(K, 512) // tuning.current().gemv_tma_steps, 8 * sms // tiles))
    n, chunk = split(n, tiles, K, 512, 0)
    return n, chunk // 512


def mma_tiles(N: int, cfg: MmaConfig) -> int:
    """Programs of a fragment launch along N: 16·warps·tiles weight rows each."""
    return cdiv(N, 16 * cfg.warps * cfg.tiles)


def mma_launch(cfg: MmaConfig, M: int, tiles: int, K: int, device):
    """(split, windows a split, windows a step) of a fragment launch. The split as for the other
    split-K kernels (~4 programs an SM, >= 4 windows each). Where that leaves a program at most
    pair_windows windows (twice that at M <= 4), a step loads two windows before it decodes either,
    and the run is rounded up to one step (<= 2 windows) or a multiple of 4 (3 -> 4, 5 -> 8): such
    programs are a chain of load latencies more than a stream, and two windows in flight a warp
    shorten it. At M = 5..8 (one token tile, the split-K sum in-kernel with two windows a step) a
    program of >= long_run_windows windows is cut to runs of long_run_cut at two a step. A given
    split keeps its windows, one a step unless cfg says more."""
    t = tuning.current()
    nwin = K // 128
    n, chunk = split(cfg.split, tiles, K, 128, 4 * launch.num_sms(device))
    per = chunk // 128
    if cfg.split or cfg.windows:
        return n, per, cfg.windows or 1
    if 4 < M <= 8 and per >= t.long_run_windows:
        return cdiv(nwin, t.long_run_cut), t.long_run_cut, 2
    if per > (2 * t.pair_windows if M <= 4 else t.pair_windows):
        return n, per, 1
    per = cdiv(per, 4) * 4 if per > 2 else 2
    return cdiv(nwin, per), per, 2


def mma_ahead(M: int) -> bool:
    """Does a fragment program of M rows load its next step before it decodes this one (AHEAD)? From
    tuning's ahead_min_m to ahead_max_m rows: the step in flight while a warp decodes costs registers
    and a few instructions a step, which pays at 5..8 rows and not at 2..4 or 9..16 (bench/ab.py
    --replay, the decode step's GPU time)."""
    t = tuning.current()
    return t.ahead_min_m <= M <= t.ahead_max_m


def wgmma_wave(cfg: WgmmaConfig, device) -> int:
    """Programs of a register-A launch that fit on the SMs at once: by shared memory (the ring of x
    tiles, words and scales) and, warp-specialized, by registers (the producer's warp takes a
    warpgroup's worth)."""
    per_sm = SMEM_PER_SM // (ring_bytes(cfg.bn, cfg.bt, cfg.stages) + 1024)
    if warp_specialized(cfg):
        per_sm = min(per_sm, 65536 // (MAX_REGS[cfg.warps] * 32 * (cfg.warps + 4)))
    return launch.num_sms(device) * max(1, per_sm)


def wgmma_split(M: int, N: int, K: int, cfg: WgmmaConfig, device):
    """(split, windows per split) of a register-A launch: split-K up to one wave of programs
    (wgmma_wave), each >= 4 windows of 128 k; more waves are slower. With decode tiles (<= 16
    tokens) up to wgmma_decode_wave of a wave: each split adds M·N·8 bytes of fp32 partials (stored,
    then read by the reduce kernel)."""
    nwin = K // 128
    tiles = cdiv(N, cfg.bn) * cdiv(M, cfg.bt)
    wave = wgmma_wave(cfg, device)
    if cfg.bt <= 16:
        wave = int(wave * tuning.current().wgmma_decode_wave)
    return split(cfg.split or max(1, min(nwin // 4, wave // tiles)), tiles, nwin, 1, 0)


def fit_stages(M: int, N: int, cfg: WgmmaConfig, device) -> WgmmaConfig:
    """cfg with fewer ring stages (3 at least) where that lets one wave hold every program of the
    launch, else cfg. A launch whose programs exceed a wave does not split (wgmma_split) and runs a
    second, part-empty wave of programs that each read all of K (32B gate_up at M = 9..16: 864 row
    tiles, 792 a wave at 4 stages, 1,056 at 3)."""
    tiles = cdiv(N, cfg.bn) * cdiv(M, cfg.bt)
    if cfg.split or warp_specialized(cfg) or tiles <= wgmma_wave(cfg, device):
        return cfg
    for stages in range(cfg.stages - 1, 2, -1):
        fewer = replace(cfg, stages=stages)
        if tiles <= wgmma_wave(fewer, device):
            return fewer
    return cfg


def deeper_ring(cfg: WgmmaConfig, programs: int, chunk: int, device) -> WgmmaConfig:
    """cfg with a 4-stage ring where it has 3 (and no given split), its programs fit one wave and run
    >= long_ring_windows windows each, and the deeper ring leaves the programs an SM as they are.
    With 64-token tiles it does: shared memory would hold 3 programs an SM at 3 stages and 2 at 4,
    but the warp-specialized kernel's registers allow 2 either way (the down weights at M = 33..64)."""
    deeper, wave = replace(cfg, stages=4), wgmma_wave(cfg, device)
    if (cfg.stages != 3 or cfg.split or chunk < tuning.current().long_ring_windows or programs > wave
            or SMEM_PER_SM < ring_bytes(cfg.bn, cfg.bt, 4) + 1024 or wgmma_wave(deeper, device) != wave):
        return cfg
    return deeper


def wgmma_launches(M: int, N: int, K: int, cfg: WgmmaConfig, device):
    """The launches of one register-A product: [(config, first weight-row tile, weight-row tiles,
    split, windows per split)]. One launch (wgmma_split), except where cfg's tiles fill whole waves
    and then part of one (M = 1024 on 32B o / down: 160 tiles on 132 SMs): a launch of the whole
    waves' worth of weight-row tiles, then one for the rows left, which ends after a fraction of a
    tile: its windows split into at most a wave of pieces where each keeps >= tail_min_windows (the
    pieces sum themselves: a round trip of their fp32 tiles through L2 costs more than the tiles),
    else the rows in tail_config's smaller tiles. cfg's ring may be made shallower (fit_stages) or
    deeper (deeper_ring) first."""
    cfg = fit_stages(M, N, cfg, device)
    nt, mt, nwin = cdiv(N, cfg.bn), cdiv(M, cfg.bt), K // 128
    n, chunk = wgmma_split(M, N, K, cfg, device)
    cfg = deeper_ring(cfg, nt * mt * n, chunk, device)
    wave = wgmma_wave(cfg, device)
    main = nt * mt // wave * wave // mt                         # weight-row tiles of whole waves
    single = [(cfg, 0, nt, n, chunk)]
    tail = tail_config()
    if n > 1 or main in (0, nt) or not warp_specialized(cfg) or cfg.split or cfg.bt <= tail.bt:
        return single
    pieces = min(wave // ((nt - main) * mt), nwin // tuning.current().tail_min_windows)
    if pieces > 1:
        return [(cfg, 0, main, 1, nwin), (cfg, main, nt - main, *split(pieces, 1, nwin, 1, 0))]
    rows = N - main * cfg.bn
    if cdiv(rows, tail.bn) * cdiv(M, tail.bt) > wgmma_wave(tail, device):
        return single
    return [(cfg, 0, main, 1, nwin), (tail, main * cfg.bn // tail.bn, cdiv(rows, tail.bn), 1, nwin)]


def dx_launch(M: int, N: int, K: int, device, n: int = 0):
    """(tiles, split, windows per split) of a register-A dx launch: split-K over the 128-n windows,
    chosen (n = 0) up to one wave of programs, each >= 4 windows."""
    tiles, nwin = cdiv(K, DX_BK) * cdiv(M, DX_BT), N // 128
    return (tiles, *split(n or max(1, min(nwin // 4, launch.num_sms(device) // tiles)), tiles, nwin, 1, 0))


def fill(programs: int, wave: int) -> float:
    """How full a launch's waves are: programs / (waves · programs a wave)."""
    return programs / (cdiv(programs, wave) * wave)


def wave_fill(M: int, launch_: tuple, device) -> float:
    """How full the waves of a register-A launch (a wgmma_launches tuple) are."""
    cfg, _, tiles, n, _ = launch_
    return fill(tiles * cdiv(M, cfg.bt) * n, wgmma_wave(cfg, device))
