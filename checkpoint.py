"""Checkpoints: Hugging Face directories in and out, quantize-on-load, random init.

A checkpoint is a directory that transformers (and vLLM, and compressed-tensors) can read:

    config.json                      the architecture and shapes (ModelConfig.to_hf), plus
                                     `quantization_config` (compressed-tensors' NVFP4 scheme) when quantized
    model.safetensors                every tensor under its state-dict key, or, sharded:
    model-00001-of-0000N.safetensors ...   with
    model.safetensors.index.json     {"metadata": {"total_size": bytes}, "weight_map": {key: shard file}}
    tokenizer*, *.jinja, ...         read by transformers' AutoTokenizer, never by us

Finding one. `resolve` turns a Hub id into a local snapshot (huggingface_hub fetches only the json,
safetensors and tokenizer files: HUB_FILES) and leaves a directory as it is. `checkpoint_files` maps
each tensor key to the file that holds it, from the index (whose shard names must stay inside the
directory) or from the single file's header; a damaged safetensors file is a ValueError naming it.
Pickle weights (.bin, .pt) are refused rather than loaded: unpickling runs arbitrary code.

Loading (`load_model`). The module tree is built on the meta device (no memory), every checkpoint key
and shape is checked against it from the safetensors headers alone, then tensors stream one at a
time with `safe_open` onto the target device. A q/k/v/o/gate/up/down weight is quantized right there
(nvfp4.quantize) and its bf16 copy dropped before the next tensor is read, so peak device memory is
the final footprint plus one group of bf16 matrices and quantize's temporaries (load_bytes).
Embeddings, lm_head, norms (Qwen3's per-head q_norm / k_norm too) and biases stay unquantized, as
in QeRL. q/k/v (and gate/up) are quantized with one shared global scale, the smallest of theirs
(quantize_group), as llm-compressor does for checkpoints meant to be served fused: the fast kernels
may then multiply a group at once. `quantizer` chooses the codes and scales, never the format:
"rtn" is nvfp4.quantize's absmax rule (llm-compressor's, bit for bit), "mse" its per-block scale
search, "gptq" gptq.py's error compensation, which runs the `calibration` token ids through the layers
as they are quantized; the linears then stream in layer order (embeddings and norms first), one
layer's bf16 weights at a time.
A compressed-tensors NVFP4 checkpoint is assigned as is. Base weights come back frozen
(requires_grad=False); LoRA adds the trainable parameters. Last, NVFP4 weights on a GPU move into the
fast kernels' layout (nvfp4.interleave, where ops.interleaves says the kernels read it) and each
layer's q/k/v and gate/up are stacked (model.stack_groups).

Random init (`build_model`). The real Qwen2.5 and Qwen3 shapes (SHAPES) with N(0, 0.02²) weights
(norms 1), drawn and quantized one group at a time: benchmarks of 7B-32B shapes on machines without
the weights.

Saving (`save_pretrained`). The base model's state dict (NVFP4 linears as weight_packed /
weight_scale / weight_global_scale, the tied lm_head once, under the embedding's key) in shards of
at most max_shard_size bytes, one shard's tensors on the CPU at a time. Every file is written under a
temporary name and renamed, so a crash never leaves a half-written file under the real name, and a
file left by an earlier save that would shadow this one (a stale index or single file) is removed.
Adapters are not base weights: lora.py saves those (PEFT format) or merges them first.

Tests: tests/test_checkpoint.py (transformers' own checkpoints load, sharded or not, and read back
what we write; compressed-tensors reads our NVFP4; key, shape, NaN, Hub and pickle errors).
"""
import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import nvfp4
import ops
import plan
from model import GROUPS, ModelConfig, RMSNorm, Transformer, rope_inv_freq, stack_groups

INIT_STD = 0.02  # build_model's random weights (transformers' initializer_range)
QUANTIZERS = {"rtn": "absmax", "mse": "mse", "gptq": "mse"}  # quantizer -> how block scales are chosen
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]

# ----------------------------------------------------------------------------------------------
# Reading


def resolve(name_or_path: str) -> str:
    """A local directory, or a Hub id fetched with huggingface_hub (json, safetensors, tokenizer files)."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        return path
    if os.path.isabs(path) or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"{name_or_path!r}: no such directory (nor a Hub id like 'Qwen/Qwen2.5-7B-Instruct')")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name_or_path, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, unknown repo, gated, ...
        raise FileNotFoundError(f"{name_or_path!r} is not a local directory and could not be fetched "
                                f"from the Hugging Face Hub: {e}") from e


def checkpoint_files(path: str) -> dict[str, str]:
    """{tensor key: safetensors file} from model.safetensors.index.json or model.safetensors. The
    index's shard names must stay inside the directory (plain relative names, no '..'): an index never
    makes us read a file elsewhere. (A shard may be a link, as in the Hub cache's snapshots.)"""
    index, single = os.path.join(path, "model.safetensors.index.json"), os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is unreadable ({type(e).__name__}: {e})") from None
        outside = sorted({v for v in weight_map.values()
                          if os.path.isabs(v) or os.path.normpath(v).split(os.sep)[0] in ("..", "")})
        if outside:
            raise ValueError(f"{index} names shard files outside {path}: {outside[:4]}")
        weight_map = {k: os.path.join(path, v) for k, v in weight_map.items()}
        absent = sorted({file for file in weight_map.values() if not os.path.isfile(file)})
        if absent:
            raise FileNotFoundError(f"{index} lists files that do not exist: {absent}")
        return weight_map
    if os.path.exists(single):
        try:
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{single} is a damaged safetensors file ({e})") from None
    if any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in os.listdir(path)):
        raise ValueError(f"{path} has only pickle weights (.bin/.pt): qerl never unpickles checkpoints "
                         "(that can run arbitrary code); convert them to safetensors first")
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


# ----------------------------------------------------------------------------------------------
# Loading: meta-device build, header checks, one tensor at a time


def group_of(linear_name: str) -> list[str]:
    """The linears quantized with one shared global scale: q/k/v and gate/up (model.GROUPS), else itself."""
    parent, _, name = linear_name.rpartition(".")
    names = GROUPS.get(parent.rpartition(".")[2], ())
    return [f"{parent}.{n}" for n in names] if name in names else [linear_name]


def _assign(model: nn.Module, key: str, value: torch.Tensor):
    """Replace the (meta) parameter or buffer `key` by `value`, cast to its declared dtype, frozen."""
    mod_name, _, attr = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        old = mod._parameters[attr]
        mod._parameters[attr] = nn.Parameter(value.to(old.dtype), requires_grad=False)
    else:
        mod._buffers[attr] = value.to(mod._buffers[attr].dtype)


def quantize_group(model, linear_names: list[str], weights: list[torch.Tensor], scales: str = "absmax"):
    """Quantize linears with one global scale, the smallest of theirs (= 448·6 / the largest amax),
    so that they can share a matmul (StackedLinear); a single linear gets its own."""
    global_scale = torch.cat([nvfp4.compute_global_scale(w) for w in weights]).min().reshape(1)
    for linear_name, weight in zip(linear_names, weights):
        _assign_nvfp4(model, linear_name, *nvfp4.quantize(weight, global_scale, linear_name + ".weight", scales))


def _assign_nvfp4(model, linear_name: str, packed, scale, global_scale):
    for attr, t in zip(("weight_packed", "weight_scale", "weight_global_scale"), (packed, scale, global_scale.clone())):
        _assign(model, f"{linear_name}.{attr}", t)


def _quantizer(model: Transformer, quantizer: str, calibration):
    """The loaders' quantize(linear names, bf16 weights) for a group: at once ("rtn", "mse"), or with
    GPTQ, held until its layer is whole and then quantized with the calibration ids ("gptq")."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {sorted(QUANTIZERS)}, got {quantizer!r}")
    if (quantizer == "gptq") != (calibration is not None):
        raise ValueError(f"quantizer={quantizer!r} with calibration={'None' if calibration is None else '...'}: "
                         "calibration token ids go with quantizer='gptq', which needs them")
    if quantizer != "gptq":
        return lambda names, weights: quantize_group(model, names, weights, QUANTIZERS[quantizer])
    import gptq
    layerwise = gptq.Layerwise(model, calibration, scales=QUANTIZERS[quantizer])

    def add(names, weights):
        for name, tensors in layerwise.add(names, weights).items():
            _assign_nvfp4(model, name, *tensors)
    return add


def _layer(key: str) -> int:
    """The decoder layer a key belongs to (model.layers.<i>...), -1 for the others."""
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def _actions(model: Transformer, shapes: dict[str, tuple]) -> dict[str, str]:
    """Match checkpoint keys (with header shapes) against the meta model: {key: "copy"|"quantize"|"skip"}.
    Raises one ValueError listing every missing, unexpected and mis-shaped key."""
    expected = dict(model.state_dict(keep_vars=True))
    tied = model.config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight")
    qlinears = {n: m for n, m in model.named_modules() if isinstance(m, nvfp4.NVFP4Linear)}
    actions, covered, unexpected, bad = {}, set(), [], []
    for key, shape in shapes.items():
        mod, _, attr = key.rpartition(".")
        if key in expected:
            actions[key], want = "copy", tuple(expected[key].shape)
            covered.add(key)
        elif attr == "weight" and mod in qlinears:  # a bf16 weight we quantize on load
            actions[key], want = "quantize", (qlinears[mod].out_features, qlinears[mod].in_features)
            covered |= {f"{mod}.weight_packed", f"{mod}.weight_scale", f"{mod}.weight_global_scale"}
        elif (tied and key == "lm_head.weight") or key.endswith(("rotary_emb.inv_freq", ".input_global_scale")):
            actions[key], want = "skip", shape  # a tied copy, a derived buffer, or a W4A4 activation scale
        else:
            unexpected.append(key)
            continue
        if tuple(shape) != want:
            bad.append(f"{key}: checkpoint {tuple(shape)} vs model {want}")
    missing = sorted(set(expected) - covered)
    if missing or unexpected or bad:
        show = lambda xs: f"{len(xs)} {xs[:8]}{' ...' if len(xs) > 8 else ''}"  # noqa: E731
        raise ValueError(f"checkpoint does not match {model.config.architecture} ({model.quant}): "
                         f"missing {show(missing)}; unexpected {show(sorted(unexpected))}; bad shapes {show(bad)}")
    return actions


def _finish(model: Transformer, device) -> Transformer:
    model.tie_weights()
    model.inv_freq = rope_inv_freq(model.config, device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"tensors left on the meta device: {left}"
    for m in model.modules():                  # the fast kernels' weight layout, where they read it
        if isinstance(m, nvfp4.NVFP4Linear) and ops.interleaves(m.weight_packed):
            m.interleave_()
    return stack_groups(model).eval()          # q/k/v and gate/up back to back: one matmul a group


def _device(device) -> torch.device:
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def weight_bytes(model: Transformer) -> int:
    """Bytes the model's tensors take on the device (tied tensors once); exact on a meta model."""
    seen = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def load_bytes(model: Transformer) -> int:
    """What loading needs: the weights + what is in flight: the largest bf16 group quantized together
    (gate_proj and up_proj) and quantize's temporaries for one of them, or the embedding."""
    cfg = model.config
    return weight_bytes(model) + 2 * max(cfg.hidden_size * 3 * cfg.intermediate_size, cfg.vocab_size * cfg.hidden_size)


def check_fits(model: Transformer, device: torch.device, calibration=None) -> None:
    """Fail before loading anything when the weights (+ what loading holds in flight: load_bytes, and
    GPTQ's working set with calibration ids) cannot fit."""
    if device.type != "cuda":
        return
    need, free = load_bytes(model), plan.free_memory(device)
    if calibration is not None and model.quant == "nvfp4":
        import gptq
        need += gptq.working_bytes(model.config, sum(map(len, calibration)))
    if need > free:
        raise ValueError(f"the {model.quant} model needs {need / 2**30:.1f} GiB for its weights (+ the bf16 "
                         f"weights in flight) but {device} has {free / 2**30:.1f} GiB free; try quant='nvfp4' or a larger GPU")


def load_model(name_or_path: str, quant: str = "nvfp4", device=None, dtype=torch.bfloat16, *,
               quantizer: str = "rtn", calibration: list[list[int]] | None = None) -> Transformer:
    """Hub id or directory (config.json + model.safetensors or sharded) -> Transformer on `device`.
    quantizer: "rtn" | "mse" | "gptq" (module docstring), for bf16 checkpoints loaded as NVFP4;
    calibration: token-id sequences, for "gptq" only (e.g. the training prompts)."""
    path = resolve(name_or_path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    cfg, device = ModelConfig.from_hf(hf), _device(device)
    if nvfp4.is_nvfp4_checkpoint(hf) and quant != "nvfp4":
        raise ValueError(f"{name_or_path} is an NVFP4 (compressed-tensors) checkpoint: load it with quant='nvfp4'")
    with torch.device("meta"):
        model = Transformer(cfg, quant, dtype)
    quantize = _quantizer(model, quantizer, calibration)
    check_fits(model, device, calibration)
    by_file, shapes, files = {}, {}, checkpoint_files(path)
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    try:
        for file, keys in by_file.items():  # headers only: nothing is read yet
            with safe_open(file, framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in keys})
    except SafetensorError as e:  # a damaged header, or an index key the shard does not hold
        raise ValueError(f"{file}: a damaged safetensors file, or one without the keys its index lists ({e})") from None
    actions = _actions(model, shapes)
    # what is copied first, then the linears layer by layer (GPTQ runs its calibration through them)
    order = sorted((k for k in actions if actions[k] != "skip"), key=lambda k: (actions[k] == "quantize", _layer(k)))
    pending = {}  # a group's first linear -> {linear: bf16 weight}: quantized once the group is read
    opened = {file: safe_open(file, framework="pt", device=str(device)) for file in by_file}  # headers only
    for key in order:
        try:
            t = opened[files[key]].get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f"{files[key]}: {key} cannot be read ({e})") from None
        # a NaN/Inf makes the sum non-finite; the exact test runs only then (isfinite is slow on CPU)
        if t.is_floating_point() and t.element_size() > 1 and not torch.isfinite(t.sum()) \
                and not torch.isfinite(t).all():
            raise ValueError(f"{key}: checkpoint tensor has NaN or Inf values ({files[key]})")
        if actions[key] == "quantize":
            name = key.rpartition(".")[0]
            group = [n for n in group_of(name) if actions.get(n + ".weight") == "quantize"]
            got = pending.setdefault(group[0], {})
            got[name] = t
            if len(got) == len(group):
                del pending[group[0]]
                quantize(list(got), list(got.values()))
                got.clear()  # the group's bf16 weights die here (GPTQ's: with their layer)
        else:
            _assign(model, key, t)
        del t  # a bf16 weight dies once its group is quantized, before the next reads
    del opened
    assert not pending, f"groups never completed: {list(pending)}"
    model.name_or_path = name_or_path
    return _finish(model, device)


# Qwen2.5 and Qwen3 config.json values (vocab, norms, RoPE, shapes), for random-init runs and benchmarks
# on machines without the weights: `build_model(SHAPES["qwen2.5-7b"])`, `train.py --random-init`.
_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6,
               max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
               bos_token_id=151643, eos_token_id=151645)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
              rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
              attention_bias=False, use_sliding_window=False, sliding_window=None, hidden_act="silu",
              bos_token_id=151643, eos_token_id=151645)
SHAPES = {
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-14b": dict(_QWEN25, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8),
    "qwen2.5-32b": dict(_QWEN25, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8),
    "qwen2.5-72b": dict(_QWEN25, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    # Qwen3: head_dim 128 given (not hidden / heads), per-head q/k norms, no q/k/v bias
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, max_window_layers=36),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, max_window_layers=64),
}


def random_init_config(name_or_path: str) -> dict:
    """The config for a random-init model: a SHAPES name or a local directory with config.json."""
    if name_or_path.lower() in SHAPES:
        return SHAPES[name_or_path.lower()]
    path = os.path.join(os.path.expanduser(name_or_path), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    raise ValueError(f"random init needs one of {sorted(SHAPES)} or a directory with config.json, "
                     f"got {name_or_path!r}")


def build_model(config, quant: str = "nvfp4", device=None, dtype=torch.bfloat16, seed: int = 0, *,
                quantizer: str = "rtn", calibration: list[list[int]] | None = None) -> Transformer:
    """Random weights (N(0, 0.02²), norms 1) with real shapes and no checkpoint: for benchmarks.
    Quantized linears are drawn and quantized one group at a time (GPTQ: one layer), so peak ≈ final +
    one bf16 group; the weights drawn do not depend on the quantizer (load_model's arguments)."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    device = _device(device)
    with torch.device("meta"):
        model = Transformer(cfg, quant, dtype)
    quantize = _quantizer(model, quantizer, calibration)
    check_fits(model, device, calibration)
    gen = torch.Generator(device).manual_seed(seed)
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    for key, t in model.state_dict(keep_vars=True).items():
        mod, _, attr = key.rpartition(".")
        if key in skip or attr in ("weight_scale", "weight_global_scale"):
            continue  # the tied copy; scales come with weight_packed
        if attr == "weight_packed":
            group = group_of(mod)
            if mod != group[0]:
                continue  # drawn with the first of its group
            ms = [model.get_submodule(n) for n in group]
            ws = [torch.randn(m.out_features, m.in_features, generator=gen, device=device, dtype=dtype).mul_(INIT_STD)
                  for m in ms]
            quantize(group, ws)
            del ws
        elif isinstance(model.get_submodule(mod), RMSNorm):
            _assign(model, key, torch.ones(t.shape, device=device))
        else:
            _assign(model, key, torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype).mul_(INIT_STD))
    model.name_or_path = None
    return _finish(model, device)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve(name_or_path))



# ----------------------------------------------------------------------------------------------
# Saving


def _atomic(file: str, write):
    """write(tmp_name), then rename: a crash never leaves a half-written file under the real name."""
    write(file + ".tmp")
    os.replace(file + ".tmp", file)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """t, copied if it is a slice of a larger allocation (StackedLinear): safetensors refuses those."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def save_pretrained(model: nn.Module, directory: str, max_shard_size: int | None = None):
    """Write config.json (+ the compressed-tensors quantization_config when quantized) and
    model.safetensors, or shards of at most max_shard_size bytes plus model.safetensors.index.json.
    Only one shard's tensors are copied to the CPU at a time. `model` is a model.Transformer."""
    sd = model.state_dict()
    if any(".base_layer." in k or ".lora_" in k for k in sd):
        raise ValueError("save_pretrained writes the base model only: save adapters with lora.save_adapter, "
                         "or export a merged bf16 model with lora.merge_lora")
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    os.makedirs(directory, exist_ok=True)
    shards, size = [[]], 0  # greedy: start a new shard when the next tensor would overflow this one
    for key, t in sd.items():
        if max_shard_size and shards[-1] and size + t.nbytes > max_shard_size:
            shards, size = shards + [[]], 0
        shards[-1].append(key)
        size += t.nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        tensors = {k: _owned(sd[k].detach().contiguous().cpu()) for k in keys}
        _atomic(os.path.join(directory, name), lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    index = os.path.join(directory, "model.safetensors.index.json")
    if len(shards) > 1:
        weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
        total = sum(t.nbytes for t in sd.values())
        index_json = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        _atomic(index, lambda tmp: Path(tmp).write_text(index_json))
    stale = index if len(shards) == 1 else os.path.join(directory, "model.safetensors")
    if os.path.exists(stale):  # left by an earlier save, it would shadow this one
        os.remove(stale)
    hf = {**model.config.to_hf(), "dtype": str(model.dtype).removeprefix("torch.")}
    if model.quant == "nvfp4":
        hf["quantization_config"] = nvfp4.quantization_config(ignore=["lm_head"])
    _atomic(os.path.join(directory, "config.json"), lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2)))


# ----------------------------------------------------------------------------------------------

if __name__ == "__main__":  # python checkpoint.py <hub id or dir> "prompt": load, then greedy without a KV cache
    import sys
    path, prompt = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "The capital of France is"
    tok, model = load_tokenizer(path), load_model(path, quant="bf16")
    ids = torch.tensor([tok(prompt)["input_ids"]], device=model.lm_head.weight.device)
    with torch.inference_mode():
        for _ in range(24):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)   # (1, T + 1): the most likely next token
    print(tok.decode(ids[0]))
