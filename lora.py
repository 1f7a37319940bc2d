"""LoRA: trainable low-rank adapters on top of frozen (possibly NVFP4) linear layers.

A frozen linear computes y = x Wᵀ (+ b) with W of shape (out, in). LoRA (Hu et al., 2021) learns
a low-rank correction ΔW = s · B A, with A (r, in), B (out, r) and r ≪ min(in, out):

    y = base(x) + s · (drop(x) Aᵀ) Bᵀ        s = alpha / r   (or alpha / sqrt(r) with rsLoRA)

B starts at zero, so the adapted model equals the base model at step 0; A starts like PEFT's
default (kaiming-uniform with a = sqrt(5), the nn.Linear init), so gradients reach B at once.
Only A and B train: Qwen2.5-7B has 6.5 B frozen linear weights and, at r = 32 on all seven
projections, 81 M adapter weights (r · Σ(in + out) = 32 · 90112 per layer, 28 layers).

QeRL keeps the base weights in NVFP4 and the adapters in higher precision. Here A and B are
fp32 parameters (so AdamW updates of size 1e-6 are not rounded away) and are cast to the
activation dtype inside forward, so a bf16 model runs bf16 matmuls while autograd delivers fp32
gradients to the parameters (the cast's backward upcasts). The base layer may be any module with
`in_features` / `out_features` and a forward (nn.Linear, nvfp4.NVFP4Linear): LoRA never reads
its weight, except to merge: `merge_lora` for export (an NVFP4 base dequantized first) and
`merged_sampling`, which a bf16 run's sampler decodes under (plan.py says where).

The cost of the cast: each forward reads A and B in fp32 and writes bf16 copies (two extra kernels
per adapted linear, ~8 bytes per adapter weight). Without autograd (sampling) the bf16 copies are
kept between calls instead: every call refreshes them in place, and a decode step's CUDA graph
(captured under ops.casts_kept) reads them as they are, so a graphed decode step has no cast
kernels. A version counter cannot tell when to refresh (fused AdamW does not always bump it), so
the rule that makes this safe is that rollout.py's prefill, which starts every generate() call,
refreshes them: eagerly, or as a prefill graph, whose capture records the refresh.

The update itself is two small GEMMs and an add, y + s · (x Aᵀ) Bᵀ as one addmm (ops.add_update,
in place without autograd). A 7B model has 196 adapted linears and a decode step runs each of them,
so on the sampler's GPU path ops.lora_linear hands the update to the kernel wing, which fuses it
into the base matmul where it can (kernels/lora.py); training always takes the torch path above.

Names follow PEFT, so adapters move between this code and the Hugging Face stack:

    model.layers.0.self_attn.q_proj                  the LoRALinear (same path as the linear it wraps)
    model.layers.0.self_attn.q_proj.base_layer       the frozen linear
    model.layers.0.self_attn.q_proj.lora_A / lora_B  fp32 parameters (r, in) / (out, r)

    adapter_model.safetensors: base_model.model.<path>.lora_A.weight, ....lora_B.weight
    adapter_config.json:       peft_type LORA, r, lora_alpha, target_modules, use_rslora, ...

so `PeftModel.from_pretrained(hf_model, dir)` loads what `save_adapter` writes and `load_adapter`
reads what PEFT saves (tests/test_lora.py checks both against PEFT's logits).

Left out: DoRA, per-module rank/alpha patterns, LoRA on embeddings, adapter bias, several named
adapters at once. Tests: tests/test_lora.py compares forward, save/load and merge with PEFT.
"""
import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import ops

# ---------------------------------------------------------------------------------------------
# constants

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PEFT's prefix: PeftModel.base_model (LoraModel).model (the HF model)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# ---------------------------------------------------------------------------------------------
# config


def parse_targets(text: str) -> tuple:
    """--lora-target-modules: PEFT's target_modules, comma-separated ('q_proj,v_proj'; a module path such as
    'layers.0.self_attn.q_proj' too), or PEFT's 'all-linear' for every projection of DEFAULT_TARGETS. A name
    must end in one of them: the decoder has no other linears, and lm_head and the embeddings take no
    adapter (an argparse type)."""
    import argparse
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all-linear"]:
        return DEFAULT_TARGETS
    bad = [n for n in names if n.rpartition(".")[2] not in DEFAULT_TARGETS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: want linears of the decoder, comma-separated, of "
                                         f"{', '.join(DEFAULT_TARGETS)} (or all-linear)")
    return tuple(dict.fromkeys(names))


@dataclass
class LoRAConfig:
    """The adapters' shape and scale. A field with a help text is a train.py flag (flags.py builds the
    command line from it; "flag" names it)."""
    r: int = field(default=32, metadata={"flag": "lora_rank", "help": "adapter rank r"})
    alpha: float = field(default=64.0, metadata={                    # the scaling's numerator
        "flag": "lora_alpha", "help": "adapter scale α (the update is α/r · BA)"})
    dropout: float = field(default=0.0, metadata={                   # in train mode only
        "flag": "lora_dropout", "help": "dropout on the adapter's input"})
    target_modules: tuple = field(default=DEFAULT_TARGETS, metadata={   # names matched as a suffix of the path
        "flag": "lora_target_modules", "type": parse_targets, "metavar": "NAMES",
        "help": "the linears that get adapters, PEFT's names, comma-separated (all-linear: all seven)"})
    use_rslora: bool = False                     # scaling alpha/sqrt(r) instead of alpha/r

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRAConfig.r must be a positive int, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"LoRAConfig.alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, str):
            raise TypeError("LoRAConfig.target_modules must be a list/tuple of module names such as "
                            f"('q_proj', 'v_proj'), got the string {self.target_modules!r}")
        self.target_modules = tuple(self.target_modules)
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(f"LoRAConfig.target_modules must be non-empty names, got {self.target_modules!r}")
        if not isinstance(self.use_rslora, bool):
            raise TypeError(f"LoRAConfig.use_rslora must be a bool, got {self.use_rslora!r}")

    @property
    def scaling(self) -> float:
        # rsLoRA (Kalajdzievski, 2023): alpha/sqrt(r) keeps the update's scale stable as r grows.
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


# ---------------------------------------------------------------------------------------------
# the adapted linear


def _device_of(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


class LoRALinear(nn.Module):
    """base(x) + scaling · dropout(x) Aᵀ Bᵀ, with `base` frozen and A, B fp32 parameters."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False, generator: torch.Generator | None = None):
        super().__init__()
        if not (hasattr(base, "in_features") and hasattr(base, "out_features")):
            raise TypeError(f"LoRALinear needs a linear-like base with in_features/out_features, "
                            f"got {type(base).__name__}")
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # Initialise on the CPU (so a seeded generator gives the same A on every device), then move.
        A = torch.empty(r, self.in_features, dtype=torch.float32)                 # (r, in)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)           # PEFT's default init
        B = torch.zeros(self.out_features, r, dtype=torch.float32)                  # (out, r)
        device = _device_of(base)
        self.lora_A = nn.Parameter(A.to(device))
        self.lora_B = nn.Parameter(B.to(device))
        self.enabled = True  # adapters_disabled() flips this to get the base (reference) policy
        self._casts = None   # (A, B) in the activation dtype, kept for sampling (see _cast)
        self.kept = None     # a copy of the base weight where the sampler merges (keep_bases), else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.base_layer(x)
        A, B = self._cast(x.dtype)
        if self.training and not isinstance(self.lora_dropout, nn.Identity):
            h = F.linear(self.lora_dropout(x), A)                           # (..., r), before the base
            return ops.add_update(self.base_layer(x), h, B, self.scaling)   # as in ops.lora_linear
        return ops.lora_linear(x, self.base_layer, A, B, self.scaling)

    def _cast(self, dtype):
        """A, B in the activation dtype: bf16 matmuls, fp32 gradients (the cast's backward upcasts).
        Without autograd the casts are kept (see the module docstring): refreshed by each call,
        except while a decode graph is captured (ops.casts_kept), which reads them as they are."""
        A, B = self.lora_A, self.lora_B
        if torch.is_grad_enabled() or A.dtype == dtype:
            return A.to(dtype), B.to(dtype)
        casts = self._casts
        if casts is None or casts[0].dtype != dtype or casts[0].device != A.device:
            with torch.inference_mode(False):   # plain tensors, writable outside inference mode too
                casts = self._casts = (torch.empty_like(A, dtype=dtype), torch.empty_like(B, dtype=dtype))
        if ops.refresh_casts(A):
            casts[0].copy_(A)
            casts[1].copy_(B)
        return casts

    def delta_weight(self) -> torch.Tensor:
        """scaling · B A in fp32, shape (out, in)."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scaling={self.scaling:g}"


# ---------------------------------------------------------------------------------------------
# injecting, listing, switching adapters


def _is_linear_like(module: nn.Module) -> bool:
    return hasattr(module, "in_features") and hasattr(module, "out_features") and not isinstance(module, LoRALinear)


def _matches(path: str, target: str) -> bool:
    # PEFT's rule for a list of targets: the full path equals the target or ends with ".target".
    return path == target or path.endswith("." + target)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{module path: LoRALinear} in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, cfg: LoRAConfig, generator: torch.Generator | None = None) -> nn.Module:
    """Wrap every target linear of `model` in a LoRALinear, in place; freeze everything else.

    Targets match the end of a module's path (`q_proj` matches `model.layers.3.self_attn.q_proj`).
    Raises ValueError when the model already has adapters, when a target name matches nothing,
    or when it matches a module that is not a linear."""
    if not isinstance(cfg, LoRAConfig):
        raise TypeError(f"apply_lora expects a LoRAConfig, got {type(cfg).__name__}")
    if lora_modules(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    found, paths = set(), []  # target names that matched; module paths to wrap, in model order
    for path, module in model.named_modules():
        hits = [t for t in cfg.target_modules if path and _matches(path, t)]
        if hits and not _is_linear_like(module):
            raise ValueError(f"apply_lora: target {hits[0]!r} matched {path} ({type(module).__name__}), "
                             "which is not a linear layer")
        if hits:
            found.update(hits)
            paths.append(path)
    missing = [t for t in cfg.target_modules if t not in found]
    if missing:
        raise ValueError(f"apply_lora: target_modules {missing} match no module of {type(model).__name__}; "
                         f"linear layers present end in {sorted(_linear_suffixes(model))}")
    for p in model.parameters():  # freeze the base: only adapters train
        p.requires_grad_(False)
    for path in paths:
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        setattr(parent, child, LoRALinear(base, cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora, generator))
    return model


def _linear_suffixes(model: nn.Module) -> set:
    return {name.rpartition(".")[2] for name, m in model.named_modules() if name and _is_linear_like(m)}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable adapter parameters (A then B of each adapted linear), for the optimizer."""
    return [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)]


def mergeable(model: nn.Module) -> list[LoRALinear]:
    """The adapters whose base holds a plain weight (nn.Linear), which W + s·B A can replace. An
    NVFP4 base cannot take the merge without being quantized again."""
    return [m for m in lora_modules(model).values() if isinstance(m.base_layer, nn.Linear)]


def keep_bases(model: nn.Module, on: bool) -> None:
    """Give every mergeable adapter a copy of its base weight (on), or drop the copies. The base is
    frozen, so a copy taken once serves the whole run: merged_sampling restores the weights from it."""
    for m in mergeable(model):
        m.kept = m.base_layer.weight.detach().clone() if on else None


@contextmanager
@torch.no_grad()
def merged_sampling(model: nn.Module):
    """Sample with the adapters merged into the weights, as TRL's GRPOTrainer hands vLLM the weights
    with PEFT's merge_adapter applied: inside, every adapter with a kept base (keep_bases) is off, and
    its base weight holds W + s·B A (delta_weight: fp32, rounded to the weight's dtype once, as
    merge_lora merges for export). The merge is in the weight's own storage, so the stacked q/k/v and
    gate/up views (model.Stack) and a CUDA graph's addresses see it. On exit each weight is copied back
    from its kept base, bit for bit, for the training pass.

    A decode step then multiplies by the weights alone: no shrink, no expand, the adapters' ~10% of
    a bf16 decode step gone, for one pass over the adapted weights a call and a second copy of them
    (plan.py decides where memory allows). The sampler's log-probs then come from merged weights; the
    trainer's stay unmerged, and the mismatch metric and its correction (grpo.py) see the difference.
    Adapters without a kept base (NVFP4 bases) run as they are."""
    mods = [m for m in lora_modules(model).values() if m.kept is not None and m.enabled]
    try:
        for m in mods:
            m.base_layer.weight.add_(m.delta_weight())           # (out, in) += fp32, one rounding
            m.enabled = False
        yield model
    finally:                                                     # also after a merge cut short (OOM)
        for m in mods:
            m.base_layer.weight.copy_(m.kept)
            m.enabled = True


@contextmanager
def adapters_disabled(model: nn.Module):
    """Run the base model: every LoRALinear returns base(x) only (the KL reference policy)."""
    mods = list(lora_modules(model).values())
    saved = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, saved):
            m.enabled = e


# ---------------------------------------------------------------------------------------------
# PEFT-format files


def _atomic_write(path: str, write) -> None:
    # Write under a temporary name in the same directory, then rename: a crash never leaves half a file.
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _target_names(model: nn.Module, mods: dict) -> list[str]:
    # Short names ("q_proj") when they select exactly the adapted modules, else the full paths.
    short = sorted({p.rpartition(".")[2] for p in mods})
    selected = {n for n, m in model.named_modules()
                if (isinstance(m, LoRALinear) or _is_linear_like(m)) and n.rpartition(".")[2] in short}
    return short if selected == set(mods) else sorted(mods)


def save_adapter(model: nn.Module, dir: str, base_model_name_or_path: str | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors in PEFT's format (fp32 tensors). The base is
    recorded as PEFT loads it from anywhere: a local directory as its absolute path (~ expanded), a Hub id
    as it is."""
    from safetensors.torch import save_file
    if base_model_name_or_path and os.path.isdir(os.path.expanduser(base_model_name_or_path)):
        base_model_name_or_path = os.path.abspath(os.path.expanduser(base_model_name_or_path))
    mods = lora_modules(model)
    if not mods:
        raise ValueError("save_adapter: the model has no LoRA adapters (call apply_lora first)")
    first = next(iter(mods.values()))
    if any((m.r, m.alpha, m.use_rslora) != (first.r, first.alpha, first.use_rslora) for m in mods.values()):
        raise ValueError("save_adapter: adapters with different r/alpha/use_rslora cannot share one config")
    tensors = {}
    for path, m in mods.items():
        tensors[f"{KEY_PREFIX}{path}.lora_A.weight"] = m.lora_A.detach().float().cpu().contiguous()
        tensors[f"{KEY_PREFIX}{path}.lora_B.weight"] = m.lora_B.detach().float().cpu().contiguous()
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    # The fields PEFT's LoraConfig needs to rebuild the same adapter; PEFT fills the rest with defaults.
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.r, "lora_alpha": first.alpha, "lora_dropout": dropout, "use_rslora": first.use_rslora,
        "target_modules": _target_names(model, mods),
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "layers_to_transform": None, "layers_pattern": None,
    }
    os.makedirs(dir, exist_ok=True)
    _atomic_write(os.path.join(dir, ADAPTER_WEIGHTS), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _atomic_write(os.path.join(dir, ADAPTER_CONFIG), lambda p: _write_text(p, json.dumps(config, indent=2) + "\n"))


def _model_id(name: str) -> str:
    """'org/name', '/cache/models--org--name/snapshots/<sha>' and '/any/dir/name' all -> 'name'."""
    name = os.path.normpath(str(name))
    m = re.search(r"models--[^/]*--([^/]+)/snapshots/", name)
    return m.group(1) if m else os.path.basename(name)


def _read_adapter_config(dir: str) -> tuple[LoRAConfig, dict]:
    path = os.path.join(dir, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_adapter: {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise ValueError(f"load_adapter: {path} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"load_adapter: {path} holds a JSON {type(c).__name__}, not an object")
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"load_adapter: {path} has peft_type {c.get('peft_type')!r}, only LORA is supported")
    for key, ok in [("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)]:
        if c.get(key, ok) != ok:
            raise ValueError(f"load_adapter: {path} sets {key}={c[key]!r}, which this LoRA does not support")
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            raise ValueError(f"load_adapter: {path} has a per-module {key}, which this LoRA does not support")
    if c.get("modules_to_save"):
        raise ValueError(f"load_adapter: {path} has modules_to_save={c['modules_to_save']}, not supported")
    targets = c.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"load_adapter: {path} has target_modules={targets!r}; only a list of names is supported")
    alpha = c.get("lora_alpha", 8)
    if isinstance(alpha, float) and not math.isfinite(alpha):
        raise ValueError(f"load_adapter: {path} has lora_alpha={alpha}, not a finite number")
    # PEFT's defaults (r 8, alpha 8, dropout 0) where a field is absent.
    try:
        return LoRAConfig(r=c.get("r", 8), alpha=alpha, dropout=c.get("lora_dropout", 0.0),
                          target_modules=tuple(targets), use_rslora=c.get("use_rslora", False)), c
    except (TypeError, ValueError) as e:
        raise ValueError(f"load_adapter: {path}: {e}") from None


def load_adapter(model: nn.Module, dir: str, base_model_name_or_path: str | None = None) -> nn.Module:
    """Load a PEFT-format LoRA adapter from `dir` into `model` (in place) and return the model.

    A model without adapters gets them first (apply_lora with the saved config). A model that
    already has adapters must have the same rank, scaling and adapted modules. If
    `base_model_name_or_path` is given and the adapter names a different base model (compared
    by model name: hub id, HF-cache snapshot or local directory), this raises ValueError.
    Only safetensors and JSON are read (never pickle)."""
    from safetensors.torch import load_file
    cfg, raw = _read_adapter_config(dir)
    saved_base = raw.get("base_model_name_or_path")
    if base_model_name_or_path and saved_base and _model_id(saved_base) != _model_id(base_model_name_or_path):
        raise ValueError(f"load_adapter: the adapter in {dir} was trained on {saved_base!r}, "
                         f"not on {base_model_name_or_path!r}")
    wpath = os.path.join(dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(wpath):
        raise FileNotFoundError(f"load_adapter: {wpath} not found (only safetensors adapters are read)")
    try:
        tensors = load_file(wpath)
    except Exception as e:  # safetensors' SafetensorError (a damaged header, a cut file), OSError
        raise ValueError(f"load_adapter: {wpath} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    bad = [k for k in tensors if not k.startswith(KEY_PREFIX) or not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if bad:
        raise ValueError(f"load_adapter: {wpath} holds tensors this LoRA does not know: {bad[:4]}")
    bad = [k for k, t in tensors.items() if not t.is_floating_point() or t.dim() != 2]
    if bad:
        t = tensors[bad[0]]
        raise ValueError(f"load_adapter: {wpath}: {bad[0]} is a {t.dim()}-D {t.dtype} tensor, not a 2-D float matrix")
    ranks = sorted({t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight")})
    if not ranks:
        raise ValueError(f"load_adapter: {wpath} holds no lora_A tensors")
    if ranks != [cfg.r]:  # before apply_lora allocates adapters of the config's rank
        raise ValueError(f"load_adapter: {dir}/{ADAPTER_CONFIG} says r={cfg.r}, the tensors of {wpath} have rank {ranks}")
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:  # a diverged run's adapter: refused, rather than evaluated as 0% or trained on
        raise ValueError(f"load_adapter: {wpath}: {bad[0]} holds NaN or Inf ({len(bad)} tensor(s) do)")

    mods = lora_modules(model)
    if not mods:
        apply_lora(model, cfg)
        mods = lora_modules(model)
    else:
        m0 = next(iter(mods.values()))
        if m0.r != cfg.r:
            raise ValueError(f"load_adapter: rank mismatch: the adapter in {dir} has r={cfg.r}, the model has r={m0.r}")
        if not math.isclose(m0.scaling, cfg.scaling):
            raise ValueError(f"load_adapter: scaling mismatch: the adapter in {dir} has scaling {cfg.scaling:g} "
                             f"(alpha={cfg.alpha}, use_rslora={cfg.use_rslora}), the model has {m0.scaling:g}")

    # The file's keys say exactly which modules carry adapters: they must be the model's.
    in_file = {k[len(KEY_PREFIX):].rsplit(".", 2)[0] for k in tensors}
    missing, extra = sorted(set(mods) - in_file), sorted(in_file - set(mods))
    if missing or extra:
        raise ValueError(f"load_adapter: target mismatch between {dir} and the model: "
                         f"adapters missing from the file: {missing[:4]}, in the file but not in the model: {extra[:4]}")
    for path, m in mods.items():
        for which, param in (("lora_A", m.lora_A), ("lora_B", m.lora_B)):
            key = f"{KEY_PREFIX}{path}.{which}.weight"
            t = tensors.get(key)
            if t is None:
                raise ValueError(f"load_adapter: {wpath} lacks {key}")
            if t.shape != param.shape:
                raise ValueError(f"load_adapter: shape mismatch for {key}: file {tuple(t.shape)}, "
                                 f"model {tuple(param.shape)} (r={m.r}, in={m.in_features}, out={m.out_features})")
            with torch.no_grad():
                param.copy_(t.to(param.dtype))
    return model


# ---------------------------------------------------------------------------------------------
# merging for export


def _base_weight(linear: nn.Module) -> torch.Tensor:
    # An NVFP4 base is dequantized (fp32); a plain nn.Linear is read as it is.
    if hasattr(linear, "dequantized_weight"):
        return linear.dequantized_weight(torch.float32)
    return linear.weight.detach().float()


@torch.no_grad()
def merge_lora(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A Hugging Face-named state dict with the adapters folded in, for export.

    Every adapted linear gives `<path>.weight` = base (dequantized if NVFP4) + scaling · B A,
    computed in fp32 and cast to `dtype` once; other NVFP4 linears are dequantized; every other
    parameter and persistent buffer is copied under its own name. A tensor shared by several
    modules (tied embeddings) appears once, under its first name, as in HF's save_pretrained.
    The model is not changed."""
    out, seen = {}, set()

    def put(name, t):
        if id(t) in seen:
            return
        seen.add(id(t))
        out[name] = t.detach().to(dtype).cpu().contiguous()

    skip = set()  # modules already emitted as a whole (an adapted linear's base_layer)
    for path, module in model.named_modules():
        if path in skip:
            continue
        prefix = path + "." if path else ""
        if isinstance(module, LoRALinear):
            base = module.base_layer
            skip.add(prefix + "base_layer")
            out[prefix + "weight"] = (_base_weight(base) + module.delta_weight()).to(dtype).cpu().contiguous()
            if getattr(base, "bias", None) is not None:
                put(prefix + "bias", base.bias)
        elif hasattr(module, "dequantized_weight"):
            out[prefix + "weight"] = module.dequantized_weight(torch.float32).to(dtype).cpu().contiguous()
            if getattr(module, "bias", None) is not None:
                put(prefix + "bias", module.bias)
        else:
            for name, p in module.named_parameters(recurse=False):
                put(prefix + name, p)
            for name, b in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    put(prefix + name, b)
    return out


# ---------------------------------------------------------------------------------------------

if __name__ == "__main__":
    # Adapter sizes for the Qwen2.5 shapes (ANCHORS.md): r · (in + out) per projection.
    shapes = {"7B": (3584, 18944, 28, 28, 4), "14B": (5120, 13824, 48, 40, 8), "32B": (5120, 27648, 64, 40, 8)}
    for name, (H, I, L, heads, kv) in shapes.items():
        D = H // heads
        per_layer = (H + heads * D) + 2 * (H + kv * D) + (heads * D + H) + 2 * (H + I) + (I + H)
        for r in (16, 32, 64):
            n = r * per_layer * L
            print(f"Qwen2.5-{name:>3} r={r:<3} {n / 1e6:7.1f} M adapter weights, {4 * n / 2**20:7.1f} MiB fp32")
