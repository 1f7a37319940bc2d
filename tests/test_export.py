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


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_a_run_exports_with_its_own_base_and_prompt(quant, smollm2_tokenizer, tmp_path, monkeypatch):
    """Two steps of a bf16 and of an NVFP4 run (the tiny model, a reward that varies, so the adapters move),
    then `export.py --adapter <checkpoint> --out X` and no other flag: the exports are of the run's base
    format, the merged model gives the logits of our model with the adapter (on the NVFP4 run's own base,
    GPTQ's by default, saved in the run directory) on the same prompt, built by
    the exported template without a system message, which is the run's prompt; PEFT loads every
    checkpoint's adapter from its adapter_config.json alone (the base named by its absolute path)."""
    import train
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import tasks
    from test_train import FAST, make_tiny_model
    monkeypatch.setattr(train.rewards, "rewards", lambda exs, texts, stats=None, **kw: [float(len(t) % 2) for t in texts])
    monkeypatch.chdir(tmp_path)                                    # the base named by a relative path
    make_tiny_model(smollm2_tokenizer, "base")
    system = "Answer in one line: a + b = c."
    train.main(["--model", "base", "--output-dir", "run", "--quant", quant, "--system-prompt", system, *FAST,
                "--max-steps", "2", "--save-every", "1", "--lr", "1e-2", "--eval-limit", "0"])
    ckpt = os.path.join("run", "checkpoint-000002")
    for step in (1, 2):
        peft = AutoPeftModelForCausalLM.from_pretrained(os.path.join("run", f"checkpoint-{step:06d}"))
        assert peft.peft_config["default"].base_model_name_or_path == str(tmp_path / "base")

    export.main(["--adapter", ckpt, "--out", "exported"])
    assert sorted(os.listdir("exported")) == sorted(["adapter", "merged"] + (["nvfp4"] if quant == "nvfp4" else []))
    question = "What is 17 + 25?"
    served = AutoTokenizer.from_pretrained("exported/merged").apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    assert served == tasks.build_prompt(AutoTokenizer.from_pretrained("base"), question, system)
    x = torch.tensor([tasks.encode_prompt(AutoTokenizer.from_pretrained("base"), question, system)])
    base = os.path.join("run", "base") if quant == "nvfp4" else "base"
    ours = lora.load_adapter(load_model(base, quant=quant, device="cpu", dtype=torch.float32), ckpt)
    assert any(m.lora_B.abs().max() > 0 for m in lora.lora_modules(ours).values()), "the adapters never moved"
    merged = AutoModelForCausalLM.from_pretrained("exported/merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = ours(x).float(), merged(x).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 3e-2, f"{quant} run: merged vs our model + adapter, max relative error {err:.2e}"
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax()), "the merged model's greedy next token"
