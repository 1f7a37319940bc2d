"""GPTQ: NVFP4 codes chosen to keep each layer's outputs, not its weights, close to the original.

nvfp4.quantize rounds every weight on its own. But a linear's job is y = x·Wᵀ on the inputs the model
actually sees, and those inputs are correlated: an error in one weight can be cancelled by nudging
the weights of the same row that multiply correlated input channels. GPTQ (Frantar et al., 2022,
arXiv 2210.17323) does this one input column at a time. For one row w (1, K) and calibration inputs
X (n, K), the objective and its Hessian are

    E(ŵ) = ‖X ŵᵀ − X wᵀ‖² / n = (ŵ − w) H (ŵ − w)ᵀ,      H = XᵀX / n        (K, K), one per input

Quantizing column k to q leaves the error δ = w_k − q; the best correction of the columns not yet
quantized (Optimal Brain Surgeon) and what it costs are, with H⁻¹ restricted to the columns left,

    w_{k+1:} −= δ / [H⁻¹]_kk · [H⁻¹]_{k,k+1:}                     cost δ² / [H⁻¹]_kk

and removing column k from H⁻¹ is one step of Gaussian elimination. GPTQ's observations: the order
of the columns barely matters, so all N rows go together in input order (one H⁻¹ for the matrix);
the rows of H⁻¹ that the successive eliminations leave are exactly the rows of the upper Cholesky
factor U of H⁻¹ (H⁻¹ = UᵀU), scaled by U_kk, so one Cholesky replaces them all:

    err_k = (w_k − q_k) / U_kk            w_{k+1:} −= err_k · U_{k,k+1:}           (N,) outer (K−k−1,)

and updates are applied lazily: within a block of 128 columns column by column, and to the columns
after it once, as Err (N, 128) · U_{block, after} (one matmul). On a GPU a block's column loop is
thousands of tiny kernels, so each block shape is captured once as a CUDA graph and replayed
(GraphedBlock). H gets 1% of its mean diagonal added first (`damp`): a few calibration tokens make XᵀX
nearly singular, and the step must stay small. An input channel the calibration never drives
(H_kk = 0) gets H_kk = 1: its weight is simply rounded.

NVFP4 specifics. A weight's grid is its 16-block's scale: s_b / g · {0, ±0.5, ..., ±6}. The scale of
a block must be fixed before its first column is quantized, so it is chosen when that column is
reached, from the block's current weights (already corrected by the columns before it), with
nvfp4.block_scales: "absmax", or by default "mse", the search over E4M3 scales near absmax, here
weighing each column's squared error by what an error there costs the layer, 1 / [H⁻¹]_kk = 1 / U_kk²
(the OBS cost above). On SmolLM2 (bench/quant.py) GPTQ takes the KL to the bf16 model from 0.23 nats
a token (absmax rounding) to 0.076; with absmax scales, or the unweighted search, it stopped near 0.11
and 0.10 on a quarter of that text. Block and lazy-update boundaries line up (128 is a multiple of
16). A column needs only its rounded values (nvfp4.round_e2m1) for its error; its codes are encoded
with its 16-block's once the block is final, one nvfp4.encode a block. The global scale g is the
original weights' (the min of a group's, as checkpoint.quantize_group takes it). The output is an ordinary compressed-tensors NVFP4 tensor: only
the chosen codes and scales differ from nvfp4.quantize's.

Layer by layer (`Layerwise`). H must come from the inputs a linear sees in the quantized model, so
the calibration sequences (token ids, e.g. the run's own training prompts) are embedded once and
their hidden states then move through the layers as each is quantized. In layer i, four groups are
quantized in the order the forward pass reaches them, each from the inputs the layer gives with the
groups before it already quantized:

    q/k/v       one H: the input_layernorm output        one global scale (the min of the three)
    o_proj      one H: the attention output
    gate/up     one H: the post_attention_layernorm output   one global scale
    down_proj   one H: silu(gate) · up

A group's members share H, so they are stacked into one matrix (rows are independent given H).
Until it is quantized a linear computes with its original weight, and after that with its
dequantized one, through NVFP4Linear.dense (the slot plan.dense_weights uses for training passes).
Then the hidden states move through the quantized layer i. Nothing of layer i + 1 is needed before
that, so a loader hands the layers over in order and frees each one's bf16 weights afterwards.

Memory, beyond the model's final NVFP4 weights, at any time: one layer's bf16 weights and their
dequantized stand-ins; one H in fp32 and, while it is inverted, two more of its size; one group
stacked, in bf16 and as the fp32 working copy; the calibration hidden states (tokens × hidden, model
dtype) and one micro-batch's activations inside a layer (batch_tokens tokens). Qwen2.5-32B (hidden
5120, intermediate 27648, 64 layers) with 65k calibration tokens: a layer's weights 0.49 G params
(2 × 0.98 GB), down_proj's H 27648² × 4 B = 3.1 GB (× 3), gate/up stacked 55296 × 5120 × 6 B = 1.7 GB,
hidden states 65k × 5120 × 2 B = 0.67 GB, a 4096-token micro-batch 0.7 GB: about 14 GB beside 20 GB
of NVFP4 weights, inside one 80 GB GPU. `working_bytes` computes it (check_fits adds it). The CUDA
graphs add their buffers, a few (N, 128) fp32 tensors per group shape (~0.1 GB for 32B's gate/up).

Left out: act-order (quantizing columns by decreasing H_kk; it would scatter a 16-block's columns
over the pass, so its scale could not be fixed when its first column comes), per-group H for MoE
experts, and the lm_head (kept bf16, as in QeRL).

Test: pytest tests/test_gptq.py checks the update against a float64 column-by-column Optimal Brain
Surgeon written out in the test, that the layer error ‖XWᵀ − XŴᵀ‖ beats nvfp4.quantize on correlated
inputs, that the output loads through compressed-tensors' decompressor, and that a streamed load
holds one layer's bf16 weights at a time. bench/quant.py measures what it does to SmolLM2's outputs.
"""
import torch

import nvfp4
import ops
from model import GROUPS, rope_inv_freq

BLOCK_SIZE = 128   # columns per lazy update (a multiple of nvfp4.BLOCK)
DAMP = 0.01        # H += DAMP · mean(diag H) · I
BATCH_TOKENS = 4096  # calibration tokens (padding included) per forward of one layer
# The groups of a layer in forward order: (parent module, linears sharing one H)
SEQUENCE = (("self_attn", GROUPS["self_attn"]), ("self_attn", ("o_proj",)),
            ("mlp", GROUPS["mlp"]), ("mlp", ("down_proj",)))


# ----------------------------------------------------------------------------------------------
# one matrix


def inverse_cholesky(H: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """H (K, K) -> U, upper triangular, with UᵀU = (H + damp · mean(diag H) · I)⁻¹ (dead channels'
    H_kk = 1 first). The rows of U are the successive eliminations' rows of H⁻¹ (module docstring)."""
    H = H.to(torch.float32).clone()
    diag = H.diagonal()
    diag[diag == 0] = 1.0                                                 # never-driven channels
    diag += damp * diag.mean()
    L, info = torch.linalg.cholesky_ex(H)
    if info.item():
        raise ValueError(f"gptq: the damped Hessian is not positive definite (leading minor {info.item()}); "
                         f"use more calibration tokens or a larger damp than {damp}")
    del H                                                                 # at most H and two more alive
    Hinv = torch.cholesky_inverse(L)
    del L
    return torch.linalg.cholesky(Hinv, upper=True)                        # (K, K)


@torch.no_grad()
def quantize(w: torch.Tensor, H: torch.Tensor, global_scale: torch.Tensor | None = None, *,
             scales: str = "mse", block_size: int = BLOCK_SIZE, damp: float = DAMP, name: str = "",
             graphs: dict | None = None):
    """W (N, K) with its inputs' Hessian H (K, K) -> (packed (N, K/2), scale (N, K/16) e4m3, g (1,)),
    the format of nvfp4.quantize. global_scale: as there (None: W's own); scales: how each 16-block's
    scale is chosen from its corrected weights ("mse" or "absmax"). graphs: a dict in which a CUDA
    weight's full blocks keep one GraphedBlock per shape (None: every block runs eagerly)."""
    where = f" for {name}" if name else ""
    if w.ndim != 2 or w.shape[1] % nvfp4.BLOCK or tuple(H.shape) != (w.shape[1],) * 2:
        raise ValueError(f"gptq.quantize{where}: needs W (N, K) with K a multiple of {nvfp4.BLOCK} and H (K, K), "
                         f"got W {tuple(w.shape)} and H {tuple(H.shape)}")
    if scales not in nvfp4.SCALES or block_size % nvfp4.BLOCK:
        raise ValueError(f"gptq.quantize{where}: scales must be one of {nvfp4.SCALES} and block_size a "
                         f"multiple of {nvfp4.BLOCK}, got {scales!r}, {block_size}")
    N, K = w.shape
    g = nvfp4.compute_global_scale(w) if global_scale is None else \
        torch.as_tensor(global_scale).to(device=w.device, dtype=torch.float32).reshape(1)
    U = inverse_cholesky(H.to(w.device), damp)                            # (K, K)
    W = w.to(torch.float32).clone()                                       # (N, K), corrected in place
    codes = torch.empty(N, K, dtype=torch.uint8, device=w.device)
    scale = torch.empty(N, K // nvfp4.BLOCK, dtype=torch.float32, device=w.device)
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        args = W[:, b0:b1], U[b0:b1, b0:b1], g, scales                    # (N, B), (B, B)
        run = block
        if graphs is not None and w.is_cuda and b1 - b0 == block_size:
            key = (N, block_size, scales, w.device)
            if key not in graphs:
                graphs[key] = GraphedBlock(*args)
            run = graphs[key]
        err = run(*args, codes[:, b0:b1], scale[:, b0 // nvfp4.BLOCK:b1 // nvfp4.BLOCK])
        W[:, b1:].addmm_(err, U[b0:b1, b1:], alpha=-1)                     # the columns after the block
    return nvfp4.pack_fp4(codes), scale.to(torch.float8_e4m3fn), g


def block(W1: torch.Tensor, U1: torch.Tensor, g: torch.Tensor, scales: str, codes: torch.Tensor,
          scale: torch.Tensor) -> torch.Tensor:
    """One lazy-update block, column by column (module docstring): W1 (N, B) is corrected in place,
    its codes (N, B) uint8 and 16-block scales (N, B/16) fp32 are written; -> err (N, B), each column's
    (w_k − q_k) / U_kk, for the update of the columns after the block."""
    err = torch.zeros_like(W1)                                            # (N, B)
    for i in range(W1.shape[1]):
        if i % nvfp4.BLOCK == 0:                                          # a 16-block starts: fix its scale
            cost = U1.diagonal()[i:i + nvfp4.BLOCK].square().reciprocal()   # (16,) 1 / [H⁻¹]_kk
            s = nvfp4.block_scales(W1[:, i:i + nvfp4.BLOCK].unsqueeze(1), g, scales, cost)  # (N, 1)
            scale[:, i // nvfp4.BLOCK] = s[:, 0]
            step = s[:, 0] / g                                            # (N,) s/g, as dequantize has it
        x = (W1[:, i] / step).clamp(-nvfp4.FP4_MAX, nvfp4.FP4_MAX)        # (N,) as nvfp4.encode scales it
        err[:, i] = (W1[:, i] - nvfp4.round_e2m1(x) * step) / U1[i, i]
        W1[:, i + 1:].addr_(err[:, i], U1[i, i + 1:], alpha=-1)           # this block's columns after i
        if i % nvfp4.BLOCK == nvfp4.BLOCK - 1:                            # its columns are final: their codes
            j = i + 1 - nvfp4.BLOCK
            codes[:, j:i + 1] = nvfp4.encode(W1[:, j:i + 1].unsqueeze(1), s, g)[:, 0]
    return err


class GraphedBlock:
    """`block` for one (N, B) shape, captured once as a CUDA graph and replayed for every block of that
    shape. A block is B columns of ~45 small kernels each (the E4M3 scale search every 16 columns
    included), too small to hide their launches: on a GPU the eager loop is bound by the host, and a
    replay issues the same kernels from the device. Inputs are copied into static buffers, the kernels
    and their order are the eager ones, so the codes and scales are the same bit for bit (tested on the
    GPU). Capture follows torch's rule: one eager warm-up on a side stream first."""

    def __init__(self, W1: torch.Tensor, U1: torch.Tensor, g: torch.Tensor, scales: str):
        (N, B), device = W1.shape, W1.device
        self.W1, self.U1, self.g = torch.empty_like(W1), torch.empty_like(U1), torch.empty_like(g)
        self.codes = torch.empty(N, B, dtype=torch.uint8, device=device)
        self.scale = torch.empty(N, B // nvfp4.BLOCK, dtype=torch.float32, device=device)
        warm = torch.cuda.Stream(device)
        warm.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(warm):                                     # makes nvfp4's cached tables
            block(W1.clone(), U1, g, scales, self.codes, self.scale)
        torch.cuda.current_stream(device).wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.err = block(self.W1, self.U1, self.g, scales, self.codes, self.scale)

    def __call__(self, W1: torch.Tensor, U1: torch.Tensor, g: torch.Tensor, scales: str, codes: torch.Tensor,
                 scale: torch.Tensor) -> torch.Tensor:
        """block's call, replayed: codes and scale are written, -> err (N, B), the graph's buffer (the
        next call overwrites it). scales is the captured one (quantize keys the graphs by it)."""
        self.W1.copy_(W1)
        self.U1.copy_(U1)
        self.g.copy_(g)
        self.graph.replay()
        codes.copy_(self.codes)
        scale.copy_(self.scale)
        return self.err


# ----------------------------------------------------------------------------------------------
# layer by layer


def working_bytes(cfg, tokens: int, batch_tokens: int = BATCH_TOKENS) -> int:
    """What Layerwise holds beyond the model's NVFP4 weights at its peak, in bytes, for a
    model.ModelConfig, `tokens` calibration tokens and bf16 activations (module docstring): a layer's
    bf16 weights and their stand-ins, the largest H and two more of its size, the largest group's
    stacked bf16 and fp32 copies, the calibration hidden states, one micro-batch inside a layer."""
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = H * (q + 2 * kv) + q * H + 3 * H * I                          # parameters of one layer
    group = max(H * (q + 2 * kv), 2 * I * H, I * H)                       # the largest stacked group
    return (2 * 2 * layer + 3 * 4 * max(H, I, q) ** 2 + (2 + 4) * group
            + 2 * tokens * H + 2 * batch_tokens * (4 * H + 3 * I))


class _Reached(Exception):
    """Raised by Layerwise._hessian's hook: the linear's input is recorded, the rest of the forward
    is not needed."""


class Layerwise:
    """GPTQ over a model being loaded: hand it each layer's bf16 linear weights in layer order (`add`)
    once the embeddings and that layer's norms and biases are in the model; it returns their NVFP4
    tensors. calibration: token-id sequences (e.g. the run's training prompts)."""

    def __init__(self, model, calibration: list[list[int]], scales: str = "mse",
                 block_size: int = BLOCK_SIZE, damp: float = DAMP, batch_tokens: int | None = None):
        vocab = model.config.vocab_size
        if not calibration or any(len(s) == 0 for s in calibration) or \
                any(not 0 <= t < vocab for s in calibration for t in s):
            raise ValueError(f"gptq: calibration must be a non-empty list of non-empty token-id sequences "
                             f"with ids in [0, {vocab}), got {len(calibration or ())} sequences")
        self.model, self.calibration, self.scales = model, calibration, scales
        self.block_size, self.damp, self.batch_tokens = block_size, damp, batch_tokens or BATCH_TOKENS
        self.layer, self.held, self.batches = 0, {}, None
        self.graphs = {}                                                  # quantize's GraphedBlocks, by shape

    def add(self, names: list[str], weights: list[torch.Tensor]) -> dict[str, tuple]:
        """Hold these linears' bf16 weights; once layer i's are all here, quantize the layer and return
        {linear name: (packed, scale, global_scale)} for all of them ({} until then)."""
        for name, w in zip(names, weights):
            i = int(name.split(".")[2])                                   # model.layers.<i>.<...>
            if i != self.layer:
                raise ValueError(f"gptq: {name} arrived while layer {self.layer} is incomplete; layers "
                                 f"must come in order")
            self.held[name] = w
        block = self.model.model.layers[self.layer]
        if len(self.held) < sum(isinstance(m, nvfp4.NVFP4Linear) for m in block.modules()):
            return {}
        out = self.quantize_layer(block, f"model.layers.{self.layer}.", self.held)
        self.layer, self.held = self.layer + 1, {}
        return out

    @torch.no_grad()
    def quantize_layer(self, block, prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, tuple]:
        """GPTQ of one layer's four groups in forward order (module docstring), then the calibration
        hidden states move through the quantized layer. -> {linear name: (packed, scale, g)}."""
        if self.batches is None:
            self.batches = self._embed()
        dtype = self.model.dtype
        for name, w in weights.items():                                   # the original weights, until quantized
            self.model.get_submodule(name).dense = w.to(dtype)
        out = {}
        for parent, names in SEQUENCE:
            full = [f"{prefix}{parent}.{n}" for n in names]
            mods = [self.model.get_submodule(n) for n in full]
            H = self._hessian(block, mods[0])                             # (K, K) fp32
            ws = [weights[n] for n in full]
            g = torch.cat([nvfp4.compute_global_scale(w) for w in ws]).min().reshape(1)
            packed, scale, _ = quantize(torch.cat(ws), H, g, scales=self.scales, block_size=self.block_size,
                                     damp=self.damp, name=full[0], graphs=self.graphs)
            del H
            rows = [w.shape[0] for w in ws]
            for n, m, p, s in zip(full, mods, packed.split(rows), scale.split(rows)):
                out[n] = (p, s, g.clone())
                m.dense = nvfp4.dequantize(p, s, g, dtype)                # later groups see it quantized
        for j, b in enumerate(self.batches):                          # in place: one copy of the states
            self.batches[j] = (self._forward(block, *b), *b[1:])
        for n in weights:
            self.model.get_submodule(n).dense = None
        return out

    def _embed(self):
        """The calibration sequences, longest first, as right-padded micro-batches of at most
        batch_tokens tokens: [(hidden (B, T, H), cos, sin (B, T, 1, D/2), real-token rows (n,))]."""
        emb = self.model.model.embed_tokens
        device = emb.weight.device
        inv_freq = rope_inv_freq(self.model.config, device)
        seqs = sorted(self.calibration, key=len, reverse=True)
        batches, i = [], 0
        while i < len(seqs):
            T = len(seqs[i])
            B = max(1, self.batch_tokens // T)
            rows = seqs[i:i + B]
            ids = torch.zeros(len(rows), T, dtype=torch.long, device=device)        # (B, T), 0-padded
            real = torch.zeros(len(rows), T, dtype=torch.bool, device=device)
            for r, s in enumerate(rows):
                ids[r, :len(s)] = torch.tensor(s, device=device)
                real[r, :len(s)] = True
            pos = torch.arange(T, device=device).expand(len(rows), T)
            x, cos, sin = ops.embed_rope(ids, pos, emb, inv_freq)                   # (B, T, H)
            batches.append((x, cos, sin, real.flatten().nonzero().squeeze(1)))
            i += len(rows)
        return batches

    @staticmethod
    def _forward(block, x, cos, sin, real):
        """The layer's output stream hˡ⁺¹ = MLP(m) + h' (model.Block) for a micro-batch."""
        y, residual = block(x, None, cos, sin)
        return y + residual

    def _hessian(self, block, linear) -> torch.Tensor:
        """H = XᵀX / n over the calibration tokens' inputs of `linear` (padding left out), fp32. The
        forward stops at `linear`: what comes after it cannot change its input."""
        K, device = linear.in_features, self.batches[0][0].device
        H, n, rows = torch.zeros(K, K, device=device), 0, [None]

        def hook(_, args):
            x = args[0].reshape(-1, K)[rows[0]].float()                   # (n_real, K)
            H.addmm_(x.T, x)
            raise _Reached

        handle = linear.register_forward_pre_hook(hook)
        try:
            for b in self.batches:
                rows[0] = b[3]
                try:
                    self._forward(block, *b)
                except _Reached:
                    pass
                n += len(b[3])
        finally:
            handle.remove()
        return H.div_(n)

