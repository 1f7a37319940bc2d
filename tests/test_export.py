"""export.py: each export, loaded by the Hugging Face stack, against our model with the adapter.

A tiny random Qwen2 checkpoint (transformers' own), our NVFP4 model of it with random adapters,
then export.py's three forms: the NVFP4 base is our 4-bit weights bit for bit (read back by our
loader and by compressed-tensors' decompressor in test_checkpoint.py); the adapter on transformers'
model of the dequantized base (peft.PeftModel) and the merged bf16 checkpoint in transformers give
our logits; every export carries the tokenizer."""
import os

import pytest
import torch
from safetensors.torch import load_file

import export
import lora
from checkpoint import load_model
from test_lora import ids, nvfp4_roundtrip_linears, randomize_adapters


@pytest.fixture
def run(tiny_hf_dir, smollm2_tokenizer, tmp_path):
    """(base dir, adapter dir, our NVFP4 model with the adapter, the HF model): a run's end state."""
    path, hf = tiny_hf_dir("qwen2", seed=3)
    for f in ("tokenizer.json", "tokenizer_config.json"):                   # any tokenizer: it is copied
        if os.path.exists(os.path.join(smollm2_tokenizer, f)):
            os.link(os.path.join(smollm2_tokenizer, f), os.path.join(path, f))
    ours = lora.apply_lora(load_model(path, quant="nvfp4", device="cpu", dtype=torch.bfloat16),
                           lora.LoRAConfig(r=4, alpha=8))
    randomize_adapters(ours, seed=5)
    adapter = str(tmp_path / "checkpoint-000007")
    lora.save_adapter(ours, adapter, path)
    return path, adapter, ours, hf


def test_three_exports_load_and_give_our_logits(run, tmp_path):
    path, adapter, ours, hf = run
    out = str(tmp_path / "exported")
    export.main(["--model", path, "--adapter", adapter, "--out", out])
    for f in export.FORMATS:
        assert os.path.exists(os.path.join(out, f, "tokenizer.json")), f"{f} has no tokenizer"
    x = ids(seed=2)
    with torch.no_grad():
        want = ours(x).float()                                               # our NVFP4 model + adapter
    scale = want.abs().max()

    # nvfp4: the very bytes our model holds, and it loads back as our base
    base = load_model(os.path.join(out, "nvfp4"), quant="nvfp4", device="cpu", dtype=torch.bfloat16)
    files = load_file(os.path.join(out, "nvfp4", "model.safetensors"))
    q = ours.model.layers[1].mlp.down_proj.base_layer
    assert torch.equal(files["model.layers.1.mlp.down_proj.weight_packed"], q.weight_packed)
    assert torch.equal(files["model.layers.1.mlp.down_proj.weight_scale"].view(torch.uint8), q.weight_scale.view(torch.uint8))
    lora.load_adapter(base, os.path.join(out, "adapter"))
    with torch.no_grad():
        assert torch.equal(base(x).float(), want), "base + exported adapter must be our model, bit for bit"

    # merged: transformers loads the bf16 checkpoint and gives our logits (bf16 rounding of W + sBA)
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        err = ((merged(x).logits - want).abs().max() / scale).item()
    assert err < 3e-2, f"merged vs ours: max relative error {err:.2e}"

    # adapter: PEFT on transformers' model of the dequantized NVFP4 base
    from peft import PeftModel
    nvfp4_roundtrip_linears(hf)
    peft = PeftModel.from_pretrained(hf.float(), os.path.join(out, "adapter")).eval()
    with torch.no_grad():
        err = ((peft(x).logits - want).abs().max() / scale).item()
    assert err < 3e-2, f"PEFT + exported adapter vs ours: max relative error {err:.2e}"


def test_bad_requests_are_refused_before_loading(run, tmp_path, capsys):
    path, adapter, _, _ = run
    out = str(tmp_path / "exported")
    for argv, message in ((["--formats", "gguf"], "unknown"), (["--formats", "nvfp4", "--quant", "bf16"], "needs --quant nvfp4")):
        with pytest.raises(SystemExit):
            export.main(["--model", path, "--adapter", adapter, "--out", out, *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export.main(["--model", path, "--adapter", str(tmp_path), "--out", out])
    assert "adapter_config.json" in capsys.readouterr().err
    export.main(["--model", path, "--adapter", adapter, "--out", out, "--formats", "adapter"])
    with pytest.raises(SystemExit):
        export.main(["--model", path, "--adapter", adapter, "--out", out, "--formats", "adapter"])
    assert "exists" in capsys.readouterr().err
