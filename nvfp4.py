"""NVFP4: 4-bit floating-point weights with two levels of scales, bit-exact with compressed-tensors.

QeRL keeps the frozen base weights of the policy in NVFP4 and trains only LoRA adapters on top.
This file is the format: a pure-torch reference quantizer, the dequantizer, the nibble packing,
`NVFP4Linear` (the frozen layer the model is built from) and the checkpoint metadata.

The number format. Each weight is an E2M1 float, a 4-bit code sign|exponent(2)|mantissa(1) whose
16 values are ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Sixteen consecutive weights of a row (along the input
dim) share one FP8 E4M3 scale, and the whole tensor shares one fp32 scale, so that the FP8 block
scales use FP8's full range:

    global_scale   g    = 448·6 / amax|W|                          fp32, (1,)
    block scale    s_b  = e4m3(clamp(g · amax|W_b| / 6, ±448))     per block of 16; 0 -> 0.125
    element        q    = e2m1(clamp(W / (s_b / g), ±6))           round to nearest, ties to even
    dequantized    W'   = q · (s_b / g)

Rounding |x| to E2M1 with ties to even gives these boundaries: ≤0.25 -> 0, <0.75 -> 0.5,
≤1.25 -> 1, <1.75 -> 1.5, ≤2.5 -> 2, <3.5 -> 3, ≤5 -> 4, else 6. A weight costs 4 + 8/16 = 4.5
bits. On Gaussian weights the relative RMS error of W' is about 9.5% (tests/test_nvfp4.py measures
it); what keeps it that low is the fine 16-wide blocks, whose scale follows the local magnitude.

Memory layout (one linear, out_features N, in_features K), exactly what llm-compressor writes:

    weight_packed        uint8          (N, K/2)   byte j of a row = code[2j] | code[2j+1] << 4
    weight_scale         float8_e4m3fn  (N, K/16)  s_b of W[n, 16b : 16b+16]
    weight_global_scale  float32        (1,)       g

Matching compressed-tensors bit for bit means copying its arithmetic, not only its formulas:
  * amax|W| and amax|W_b|/6 are computed in the weight's own dtype (so amax/6 is rounded to bf16
    for a bf16 weight) and only then multiplied by the fp32 global scale;
  * g is computed as `reciprocal(amax) · 2688` (that is what Python's `2688 / tensor` does), two
    roundings in the weight's dtype; amax is clamped to the dtype's smallest normal first and an
    infinite g (an all-zero or nearly-zero tensor) becomes 1.0. For fp16 weights g overflows
    already when amax < ~0.04, so fp16 tensors with small weights get g = 1.0 and coarse,
    subnormal block scales: a compressed-tensors quirk reproduced here, use bf16 or fp32;
  * divisions are true divisions by tensors (on CUDA, `t / python_float` is a multiplication by
    the reciprocal and can differ in the last bit);
  * a block of zeros stores s_b = 0.125 (E4M3's machine epsilon) instead of 0, and so does a
    block so small relative to the tensor that its scale rounds to 0 (its elements become ±0);
  * a negative weight that rounds to zero keeps its sign (code 0b1000, "-0"); an input -0.0 is
    stored as +0 (code 0).
Dequantization multiplies q by the fp32 quotient s_b/g, rounded once, then casts to the wanted
dtype: compressed-tensors' decompressor returns exactly `dequantize(..., dtype=torch.bfloat16)`.

Choosing the block scales (`quantize(..., scales=)`). The format fixes how a block is decoded,
not how its scale is chosen, so any E4M3 value is a valid s_b. "absmax" is the rule above, what
llm-compressor writes (the reference, bit for bit). It maps the block's largest weight onto 6, which
leaves the wide 4 -> 6 gap for the block's top third. "mse" tries the E4M3 codes next to the absmax
scale (SCALE_SEARCH: from 2 codes below, where the largest weight is clipped to 6, to 6 above,
where it lands near 4) and keeps, per block, the one whose dequantized block is nearest in squared
error; the absmax scale is among them and wins ties, so no block gets worse. On SmolLM2-135M it cuts
the weights' relative RMS error from 9.5% to 7.9%, at ~8x quantize's work, yet leaves the model's
KL to bf16 where absmax leaves it (0.225 against 0.226 nats a token, bench/quant.py; a checkpoint
rebuilt from a 4-bit GGUF, so a pessimistic case): a plain squared error counts every weight alike,
and down_proj's output error even grows. `importance` weighs each element's error; gptq.py passes
what an error in each input column costs the layer, and there the search pays.

What this file leaves out: activation quantization (this is weight-only, W4A16), padding of K to a
multiple of 16, and the fusion of q/k/v (or gate/up) into one matmul, which needs one shared global
scale: pass `global_scale=min(compute_global_scale(w) for w in group)` to `quantize`, as
llm-compressor does.
NVFP4Linear multiplies through the seam (ops.nvfp4_linear): on a GPU a kernel reads the 4-bit
weight as it is (marlin_kernel.py teaches how; kernels/ holds the fast ones), elsewhere the weight is
dequantized and F.linear multiplies.

Test: pytest tests/test_nvfp4.py compares bytes and scales with compressed-tensors' own quantizer
and compressor, loads our checkpoints through compressed-tensors' decompressor, and checks the
dequantizer against a float64 formula.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import ops

# ----------------------------------------------------------------------------------------------
# constants

FP4_MAX = 6.0            # largest E2M1 magnitude
FP8_MAX = 448.0          # largest E4M3 (fn) magnitude
BLOCK = 16               # weights per E4M3 block scale, along the input dim
ZERO_BLOCK_SCALE = 0.125 # the scale compressed-tensors stores for a block of zeros (E4M3 "eps")
FORMAT = "nvfp4-pack-quantized"
QUANT_CHUNK = 1 << 21    # weights per quantize() chunk: its temporaries stay under ~32 bytes each
SCALES = ("absmax", "mse")  # how quantize() chooses the block scales (module docstring)
SCALE_SEARCH = (-2, -1, 1, 2, 3, 4, 5, 6)  # E4M3 code offsets from the absmax scale that "mse" tries

# code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rounding |x| to the nearest magnitude, ties to the even code (mantissa bit 0: values 0, 1, 2, 4):
# above a boundary whose lower neighbour is even we round up only when strictly greater...
_ROUND_UP_ABOVE = (0.25, 1.25, 2.5, 5.0)     # between 0|0.5, 1|1.5, 2|3, 4|6
# ...and at a boundary whose upper neighbour is even, the tie itself rounds up.
_ROUND_UP_FROM = (0.75, 1.75, 3.5)           # between 0.5|1, 1.5|2, 3|4

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------
# pure-torch reference: quantize, dequantize, pack

def _where(name: str) -> str:
    return f" for {name}" if name else ""


def _check_weight(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT_DTYPES:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"nvfp4.quantize{_where(name)}: expected a float16/bfloat16/float32/float64 "
                        f"tensor, got {got}")
    if w.ndim != 2:
        raise ValueError(f"nvfp4.quantize{_where(name)}: expected a 2-D weight (out, in), got shape "
                         f"{tuple(w.shape)}")
    if w.shape[1] % BLOCK != 0:
        raise ValueError(f"nvfp4.quantize{_where(name)}: in_features {w.shape[1]} is not a multiple of "
                         f"the NVFP4 block size {BLOCK}")
    bad = (~torch.isfinite(w)).sum().item()
    if bad:
        raise ValueError(f"nvfp4.quantize{_where(name)}: the weight has {bad} NaN/Inf values; "
                         f"refusing to quantize")


def compute_global_scale(w: torch.Tensor) -> torch.Tensor:
    """g = 448·6 / amax|w| as a (1,) fp32 tensor, rounded exactly as compressed-tensors rounds it."""
    amax = w.abs().amax().clamp(min=torch.finfo(w.dtype).tiny)         # () in w.dtype
    g = amax.reciprocal() * (FP8_MAX * FP4_MAX)                          # = Python's 2688 / amax
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


@functools.cache
def _boundaries(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """_ROUND_UP_ABOVE and _ROUND_UP_FROM as tensors, made once per dtype and device (not per call)."""
    return (torch.tensor(_ROUND_UP_ABOVE, dtype=dtype, device=device),
            torch.tensor(_ROUND_UP_FROM, dtype=dtype, device=device))


@functools.cache
def _fp4_max(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """FP4_MAX as a 0-d tensor, made once per dtype and device: block_scales runs inside GPTQ's CUDA
    graph, where a host-to-device copy may not happen."""
    return torch.tensor(FP4_MAX, dtype=dtype, device=device)


def _e2m1_magnitudes(a: torch.Tensor) -> torch.Tensor:
    """|x| in [0, 6] -> the index 0..7 (int32) of the nearest E2M1 magnitude, ties to even. bucketize
    counts the boundaries t with t < a (right=False) or t <= a (right=True): two passes over the tensor
    instead of one comparison per boundary."""
    above, from_ = _boundaries(a.dtype, a.device)
    return torch.bucketize(a, above, out_int32=True) + torch.bucketize(a, from_, out_int32=True, right=True)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round x (already in [-6, 6]) to E2M1 codes (uint8 0..15), ties to even."""
    return _e2m1_magnitudes(x.abs()).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)   # sign in bit 3


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (already in [-6, 6], fp32) -> the E2M1 value its code stands for: E2M1_VALUES[_e2m1_codes(x)],
    without forming the code (GPTQ rounds one column at a time and needs the value only)."""
    v = _e2m1_table(x.device)[:8][_e2m1_magnitudes(x.abs())]
    return torch.where(x < 0, -v, v)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes 0..15 -> (N, K/2) uint8, even element in the low nibble."""
    if codes.dtype != torch.uint8 or codes.ndim != 2 or codes.shape[1] % 2:
        raise ValueError(f"pack_fp4: expected (N, K) uint8 codes with even K, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 codes 0..15 (inverse of pack_fp4)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"unpack_fp4: expected (N, K/2) uint8, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)  # (N, K/2, 2) -> (N, K)


@torch.no_grad()
def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "",
             scales: str = "absmax"):
    """W (N, K) -> (packed uint8 (N, K/2), scale float8_e4m3fn (N, K/16), global_scale fp32 (1,)).

    global_scale: use this g instead of the tensor's own (a group of fused layers shares the min).
    name: the tensor's name, for error messages.
    scales: "absmax" (compressed-tensors' rule, bit for bit) or "mse" (per-block search, module docstring)."""
    _check_weight(w, name)
    if scales not in SCALES:
        raise ValueError(f"nvfp4.quantize{_where(name)}: scales must be one of {SCALES}, got {scales!r}")
    N, K = w.shape
    if global_scale is None:
        global_scale = compute_global_scale(w)
    else:
        global_scale = torch.as_tensor(global_scale)
        if global_scale.numel() != 1 or not (torch.isfinite(global_scale).all() and global_scale > 0):
            raise ValueError(f"nvfp4.quantize{_where(name)}: global_scale must be one positive "
                             f"finite number, got {global_scale}")
        global_scale = global_scale.to(device=w.device, dtype=torch.float32).reshape(1)
    # Rows are independent given g: quantize them in chunks, so the temporaries stay a few times
    # one chunk (≤ 2^21 weights) whatever the matrix (loading a 7B/32B model streams through here).
    rows = max(1, QUANT_CHUNK // K)
    parts = [_quantize_rows(w[i:i + rows], global_scale, scales) for i in range(0, N, rows)]
    return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts]), global_scale


def _quantize_rows(w: torch.Tensor, global_scale: torch.Tensor, scales: str):
    """quantize() of a (n, K) slice with a given global scale -> (packed, scale)."""
    blocks = w.unflatten(1, (w.shape[1] // BLOCK, BLOCK))               # (n, K/16, 16)
    scale = block_scales(blocks, global_scale, scales)                   # (n, K/16) in cdt
    codes = encode(blocks, scale, global_scale).flatten(1)               # (n, K) uint8
    return pack_fp4(codes), scale.to(torch.float8_e4m3fn)


def block_scales(blocks: torch.Tensor, global_scale: torch.Tensor, scales: str = "absmax",
                 importance: torch.Tensor | None = None) -> torch.Tensor:
    """(..., B, 16) weights -> their (..., B) block scales s_b, E4M3 values held in fp32 (fp64 for
    fp64 weights), a zero scale replaced by 0.125. "absmax": e4m3(g·amax/6); "mse": the candidate of
    SCALE_SEARCH (and the absmax one) whose dequantized block has the least squared error, each
    element's weighted by `importance` (broadcast to (..., B, 16); None: all 1)."""
    cdt = torch.promote_types(blocks.dtype, torch.float32)
    # amax/6 in the weights' dtype (a tensor divisor: true division on every device)
    scale = global_scale * (blocks.abs().amax(dim=-1) / _fp4_max(blocks.dtype, blocks.device))  # (..., B) in cdt
    scale = scale.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(cdt)
    scale = torch.where(scale == 0, ZERO_BLOCK_SCALE, scale)             # never divide by 0
    if scales == "absmax":
        return scale
    # E4M3 codes of positive values are ordered like the values: code ± 1 is the next scale up or down
    code = scale.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    best, best_err = scale, _squared_error(blocks, scale, global_scale, importance)  # (..., B)
    for offset in SCALE_SEARCH:                                          # 0x7E = 448; 0x7F is NaN
        cand = (code + offset).clamp(1, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).to(cdt)
        err = _squared_error(blocks, cand, global_scale, importance)
        better = err < best_err                                          # ties keep the absmax scale
        best, best_err = torch.where(better, cand, best), torch.where(better, err, best_err)
    return best


def _squared_error(blocks, scale, global_scale, importance=None):
    """Σ over each block of (dequantized - w)² (· importance) with block scales `scale`: (..., B, 16) -> (..., B)."""
    step = (scale / global_scale).unsqueeze(-1)                          # (..., B, 1) s/g
    q = _e2m1_table(blocks.device).to(step.dtype)[encode(blocks, scale, global_scale).long()]
    err = (q * step - blocks.to(step.dtype)).square_()
    return (err if importance is None else err.mul_(importance)).sum(-1)


def encode(blocks: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """(..., B, 16) weights and their (..., B) block scales -> E2M1 codes (..., B, 16) uint8:
    W / (s/g), clamped to ±6 and rounded to nearest, ties to even."""
    x = blocks.to(scale.dtype) / (scale / global_scale).unsqueeze(-1)    # (..., B, 16)
    return _e2m1_codes(x.clamp(-FP4_MAX, FP4_MAX))


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """E2M1_VALUES as an fp32 tensor on device, made once: a CUDA graph being captured (the sampler's
    decode step, at fp32) may not copy it from the host."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K/2) uint8, (N, K/16) float8_e4m3fn, (1,) fp32 -> W' (N, K) in dtype (fp32 math)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise TypeError(f"dequantize: packed must be a 2-D uint8 tensor, got {packed.dtype} "
                        f"{tuple(packed.shape)}")
    if scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize: scale must be float8_e4m3fn, got {scale.dtype}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise TypeError(f"dequantize: global_scale must be one float32 value, got {global_scale.dtype} "
                        f"{tuple(global_scale.shape)}")
    N, K = packed.shape[0], packed.shape[1] * 2
    if K % BLOCK or tuple(scale.shape) != (N, K // BLOCK):
        raise ValueError(f"dequantize: packed {tuple(packed.shape)} needs scale ({N}, {K // BLOCK}), "
                         f"got {tuple(scale.shape)}")
    q = _e2m1_table(packed.device)[unpack_fp4(packed).long()].unflatten(1, (K // BLOCK, BLOCK))  # (N, K/16, 16) fp32
    step = scale.to(torch.float32) / global_scale.reshape(1)              # (N, K/16) fp32 s/g
    return (q * step.unsqueeze(-1)).flatten(1).to(dtype)                  # (N, K)


# ----------------------------------------------------------------------------------------------
# the kernels' layout: 16 x 128 tiles

def interleave(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed-tensors layout -> the GPU kernels' (same shapes and dtypes, bytes moved):
    W cut into 16-row x 128-k tiles, each stored whole (its 16 x 64 packed bytes, and its 16 x 8
    scales, row-major), the tiles of a 16-row group one after another along K. A decode kernel gives each
    lane 16 bytes of one row and each warp 8 or 16 rows at a time (the mma.sync fragments); in
    the plain layout those rows lie K/2 bytes apart, here a warp's load is 512 contiguous bytes,
    which the memory system serves in far fewer transactions. Needs N % 16 == K % 128 == 0."""
    return _tiles(packed, scale, inverse=False)


def deinterleave(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of interleave: back to the compressed-tensors layout."""
    return _tiles(packed, scale, inverse=True)


def _tiles(packed, scale, inverse):
    N, K = packed.shape[0], packed.shape[1] * 2
    if packed.dtype != torch.uint8 or packed.ndim != 2 or tuple(scale.shape) != (N, K // BLOCK) or N % 16 or K % 128:
        raise ValueError(f"interleave: needs packed (N, K/2) uint8 and scale (N, K/16) with N % 16 == 0 and "
                         f"K % 128 == 0, got {packed.dtype} {tuple(packed.shape)}, {tuple(scale.shape)}")

    def move(t, width):                    # (N/16, 16 rows, K/128, width) <-> (N/16, K/128, 16 rows, width)
        shape = (N // 16, K // 128, 16, width) if inverse else (N // 16, 16, K // 128, width)
        return t.reshape(shape).transpose(1, 2)
    p, s = move(packed, 64), move(scale.view(torch.uint8), 8)
    return p.reshape(N, K // 2), s.reshape(N, K // 16).view(scale.dtype)


def _plain(packed, scale, interleaved):
    return deinterleave(packed, scale) if interleaved else (packed, scale)


# ----------------------------------------------------------------------------------------------
# module

class NVFP4Linear(nn.Module):
    """A frozen linear layer stored as NVFP4; state_dict keys and bytes are compressed-tensors' own.
    On CUDA the buffers hold interleave()'s layout for the kernels (`interleaved`; from_weight and
    the model loaders call interleave_()), and state_dict() / load_state_dict() convert."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"NVFP4Linear: in_features {in_features} is not a multiple of {BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2,
                                                          dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.interleaved = False
        self.dense = None        # a dequantized copy for training passes (plan.dense_weights), else None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    global_scale: torch.Tensor | None = None, name: str = "") -> "NVFP4Linear":
        """Quantize a dense (out, in) weight into a new NVFP4Linear on weight.device."""
        packed, scale, g = quantize(weight, global_scale, name=name)
        dtype = bias.dtype if bias is not None else weight.dtype
        layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=dtype)
        layer.weight_packed, layer.weight_scale, layer.weight_global_scale = packed, scale, g
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer.interleave_() if ops.interleaves(weight) else layer

    def interleave_(self) -> "NVFP4Linear":
        """Move the weight into the kernels' layout (interleave) where the shape allows; the torch
        path works on either layout, so the loaders call this where ops.interleaves says."""
        if not self.interleaved and self.out_features % 16 == 0 and self.in_features % 128 == 0:
            self.weight_packed, self.weight_scale = interleave(self.weight_packed, self.weight_scale)
            self.interleaved = True
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(*_plain(self.weight_packed, self.weight_scale, self.interleaved),
                          self.weight_global_scale, dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.interleaved:     # compressed-tensors' bytes, whatever the kernels read
            keys = (prefix + "weight_packed", prefix + "weight_scale")
            destination[keys[0]], destination[keys[1]] = deinterleave(*(destination[k] for k in keys))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        """Loads compressed-tensors' bytes, then interleaves them again if this layer was."""
        again = self.interleaved and prefix + "weight_packed" in state_dict
        if again:
            self.interleaved = False
        super()._load_from_state_dict(state_dict, prefix, *args)
        if again:
            self.interleave_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: input has {x.shape[-1]} features, expected {self.in_features}")
        if self.dense is not None:                      # one dequantization a step, not one a call
            return F.linear(x, self.dense, self.bias)
        return ops.nvfp4_linear(self, x)                # the 4-bit weight read as it is, where a kernel runs

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=nvfp4 (e2m1, e4m3 per {BLOCK}, fp32 global)")


# ----------------------------------------------------------------------------------------------
# checkpoint metadata (config.json "quantization_config")

def quantization_config(ignore: list[str]) -> dict:
    """The block llm-compressor writes for weight-only NVFP4 (preset NVFP4A16) on every Linear
    except the modules in `ignore` (e.g. ["lm_head"])."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": BLOCK,
               "strategy": "tensor_group", "dynamic": False, "actorder": None, "block_structure": None,
               "observer": "memoryless_minmax", "observer_kwargs": {},
               "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None,
             "output_activations": None, "format": FORMAT}
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def is_nvfp4_checkpoint(hf_config: dict) -> bool:
    """True when config.json describes compressed-tensors NVFP4 weights (packed, E4M3/16, fp32).

    Activation settings are not checked: an NVFP4 W4A4 checkpoint has the same weight tensors."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return False
    if qc.get("quantization_status", "compressed") != "compressed":
        return False
    groups = list((qc.get("config_groups") or {}).values())
    return bool(groups) and all(
        (g.get("format") or qc.get("format")) == FORMAT
        and (g.get("weights") or {}).get("num_bits") == 4
        and (g.get("weights") or {}).get("type") == "float"
        and (g.get("weights") or {}).get("group_size") == BLOCK
        for g in groups)


if __name__ == "__main__":
    torch.manual_seed(0)
    w = torch.randn(256, 1024, dtype=torch.bfloat16)
    packed, scale, g = quantize(w, name="demo")
    err = (dequantize(packed, scale, g) - w.float()).norm() / w.float().norm()
    print(f"W {tuple(w.shape)} bf16 {w.numel() * 2} B -> {packed.numel() + scale.numel() + 4} B, "
          f"global scale {g.item():.2f}, relative RMS error {err:.4f}")
