"""Hugging Face checkpoint directories on disk: find one, list its tensors, write one.

A checkpoint is a directory that transformers (and vLLM, and compressed-tensors) can read:

    config.json                      the architecture and shapes (ModelConfig.to_hf), plus
                                     `quantization_config` (compressed-tensors' NVFP4 scheme) when quantized
    model.safetensors                every tensor under its state-dict key, or, sharded:
    model-00001-of-0000N.safetensors ...   with
    model.safetensors.index.json     {"metadata": {"total_size": bytes}, "weight_map": {key: shard file}}
    tokenizer*, *.jinja, ...         read by transformers' AutoTokenizer, never by us

Reading. `resolve` turns a Hub id into a local snapshot (huggingface_hub fetches only the json,
safetensors and tokenizer files: HUB_FILES) and leaves a directory as it is. `checkpoint_files` maps
each tensor key to the file that holds it, from the index or from the single file's header, so that
model.load_model can check every key and shape before it reads a byte of data. Pickle weights (.bin,
.pt) are refused rather than loaded: unpickling runs arbitrary code.

Writing. `save_pretrained` writes the base model's state dict (NVFP4 linears as weight_packed /
weight_scale / weight_global_scale, the tied lm_head once, under the embedding's key) in shards of at
most max_shard_size bytes, copying one shard's tensors to the CPU at a time. Every file is written
under a temporary name and renamed, so a crash never leaves a half-written file under the real name,
and a file left by an earlier save that would shadow this one (a stale index, a stale single file) is
removed. Adapters are not base weights: lora.py saves those (PEFT format) or merges them first.

Tests: tests/test_hf_checkpoint.py (transformers and compressed-tensors read what we write, sharded
and not; NVFP4 checkpoints reload without re-quantizing); tests/test_model.py loads transformers'
own (sharded) checkpoints and checks the Hub and pickle errors.
"""
import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import nvfp4

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
    """{tensor key: safetensors file} from model.safetensors.index.json or model.safetensors."""
    index, single = os.path.join(path, "model.safetensors.index.json"), os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        absent = sorted({file for file in weight_map.values() if not os.path.exists(file)})
        if absent:
            raise FileNotFoundError(f"{index} lists files that do not exist: {absent}")
        return weight_map
    if os.path.exists(single):
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    if any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in os.listdir(path)):
        raise ValueError(f"{path} has only pickle weights (.bin/.pt): qerl never unpickles checkpoints "
                         "(that can run arbitrary code); convert them to safetensors first")
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


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
