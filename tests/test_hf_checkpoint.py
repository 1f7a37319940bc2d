"""hf_checkpoint.py: the checkpoint directories we write are what transformers and compressed-tensors
read, sharded or not, and what we read back.

References are independent of our writer: transformers' own Qwen2/Llama reading our files (fp32
logits compared with a relative max-error bound), transformers writing the sharded checkpoint we
load, and compressed-tensors' decompressor reading our NVFP4 linears.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import nvfp4
from hf_checkpoint import save_pretrained
from model import load_model
from test_model import batch, hf_logits, load32, rel_err

# ----------------------------------------------------------------------------------------------
# NVFP4 checkpoints: our layout, read back without re-quantizing, read by compressed-tensors


def test_nvfp4_save_reload_without_requantizing(tiny_hf_dir, tmp_path, monkeypatch):
    path, _ = tiny_hf_dir("qwen2")
    model = load32(path, quant="nvfp4")
    out = str(tmp_path / "nvfp4")
    save_pretrained(model, out)
    config = json.load(open(os.path.join(out, "config.json")))
    assert nvfp4.is_nvfp4_checkpoint(config) and config["quantization_config"]["ignore"] == ["lm_head"]
    saved = load_file(os.path.join(out, "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert saved[f"{q}.weight_packed"].dtype == torch.uint8 and saved[f"{q}.weight_packed"].shape == (64, 32)
    assert saved[f"{q}.weight_scale"].dtype == torch.float8_e4m3fn and saved[f"{q}.weight_scale"].shape == (64, 4)
    assert saved[f"{q}.weight_global_scale"].shape == (1,) and f"{q}.bias" in saved and f"{q}.weight" not in saved
    assert "lm_head.weight" in saved

    def no_quantize(*a, **k):
        raise AssertionError("load_model re-quantized an NVFP4 checkpoint")
    monkeypatch.setattr(nvfp4, "quantize", no_quantize)
    again = load32(out, quant="nvfp4")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # bitwise (float8 compared through its bytes)
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    ids, pos = batch()
    with torch.no_grad():
        assert torch.equal(model(ids, pos), again(ids, pos))
    with pytest.raises(ValueError, match="quant='nvfp4'"):
        load_model(out, quant="bf16", device="cpu")


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_reads_our_nvfp4_checkpoint(tiny_hf_dir, tmp_path):
    """transformers + compressed-tensors decompress each linear of our file to our dequantized weight."""
    pytest.importorskip("compressed_tensors")   # a test dependency (requirements.txt); the GPU box lacks it
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    path, _ = tiny_hf_dir("llama", tie=True)
    model = load32(path, quant="nvfp4")
    save_pretrained(model, str(tmp_path))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True))
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nvfp4.NVFP4Linear):
            theirs, ours = ref.get_submodule(name).weight.float(), mod.dequantized_weight(torch.float32)
            # compressed-tensors decompresses to bf16; accept exact or exact-after-bf16-rounding
            assert torch.equal(theirs, ours) or torch.equal(theirs, ours.bfloat16().float()), name
            n += 1
    assert n == 14


# ----------------------------------------------------------------------------------------------
# sharded checkpoints, round trip through transformers


def test_sharded_checkpoints_load_and_round_trip(tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    path, hf = tiny_hf_dir("qwen2")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # sharded by transformers itself
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    model = load32(str(tmp_path / "hf"))
    ids, pos = batch()
    with torch.no_grad():
        ref = hf_logits(hf, ids, pos)
        err = rel_err(model(ids, pos), ref)
    ours = str(tmp_path / "ours")
    save_pretrained(model, ours, max_shard_size=40_000)  # our writer, sharded; transformers reads it
    shards = [f for f in os.listdir(ours) if f.startswith("model-")]
    back = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32).eval()
    again = load32(ours)
    with torch.no_grad():
        err_hf, err_again = rel_err(hf_logits(back, ids, pos), ref), rel_err(again(ids, pos), ref)
    print(f"sharded: {len(shards)} shards; rel err ours {err:.1e}, transformers reading ours {err_hf:.1e}")
    assert len(shards) > 2 and not os.path.exists(os.path.join(ours, "model.safetensors"))
    assert err < 1e-5 and err_hf < 1e-5 and err_again < 1e-5
    save_pretrained(model, ours)  # back to one file: the stale index must go
    assert not os.path.exists(os.path.join(ours, "model.safetensors.index.json"))
    assert rel_err(load32(ours)(ids, pos).detach(), ref) < 1e-5
