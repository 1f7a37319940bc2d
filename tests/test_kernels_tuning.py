"""kernels/tuning.py and the package seam: using() makes a Tuning current and restores the previous
one (also on an exception, also nested); a replaced field moves the route it names at the next call;
fields are validated with messages that name them; `import kernels` works without Triton."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import gemm, launch
from kernels.tuning import Tuning, current, using

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_using_restores_the_previous_tuning_on_exit_and_on_exceptions():
    before = current()
    assert before == Tuning() and before.pdl and before.fused
    with using(dataclasses.replace(before, pdl=False)) as t:
        assert current() is t and not current().pdl
        with using(dataclasses.replace(t, merge_max_parts=0)):
            assert current().merge_max_parts == 0 and not current().pdl
        assert current() is t
    assert current() is before
    with pytest.raises(RuntimeError, match="inside"):
        with using(dataclasses.replace(before, reduce_in_kernel=False)):
            raise RuntimeError("inside")
    assert current() is before and current().reduce_in_kernel
    with pytest.raises(TypeError, match="Tuning"):
        with using({"pdl": False}):
            pass


def test_a_replaced_field_moves_the_route_it_names():
    """dequant_min_m moves where dequantize + cuBLAS starts, wgmma_small_min_m where the register-A
    kernel takes the down weights (on a pretend sm_90), fused turns runs() off, pdl the launch
    keywords; read at call time, undone on exit."""
    cpu = torch.device("cpu")
    assert gemm.route(300, 37888, 3584, cpu, False) == "tiles"
    with using(dataclasses.replace(current(), dequant_min_m=256)):
        assert gemm.route(300, 37888, 3584, cpu, False) == "dequant+cublas"
    assert gemm.route(300, 37888, 3584, cpu, False) == "tiles"
    x = torch.zeros(1)
    assert not kernels.runs(x)                                           # a CPU tensor
    with using(dataclasses.replace(current(), fused=False)):
        assert not kernels.runs(x)
    assert launch.pdl_launch(cpu) == dict(USE_PDL=False, launch_pdl=False)


def test_wgmma_small_min_m_moves_the_register_a_route(monkeypatch):
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    dev = torch.device("cuda")
    assert [gemm.route(M, 3584, 18944, dev, True) for M in (1, 2, 8)] == ["gemv", "wgmma", "wgmma"]
    with using(dataclasses.replace(current(), wgmma_small_min_m=8)):
        assert [gemm.route(M, 3584, 18944, dev, True) for M in (8, 9)] == ["fragment", "wgmma"]
    with using(dataclasses.replace(current(), wgmma_small_min_m=16)):
        assert [gemm.route(M, 3584, 18944, dev, True) for M in (9, 16, 17)] == ["fragment", "fragment", "wgmma"]


def test_fields_are_validated_by_name():
    with pytest.raises(ValueError, match="Tuning.wave_fill"):
        Tuning(wave_fill=1.5)
    with pytest.raises(ValueError, match="Tuning.merge_chunk"):
        Tuning(merge_chunk=-1)
    with pytest.raises(ValueError, match="Tuning.lora_max_m"):
        Tuning(lora_max_m=65)
    with pytest.raises(ValueError, match="Tuning.lm_head_max_rows"):
        Tuning(lm_head_max_rows=3)
    with pytest.raises(ValueError, match="Tuning.norm_shrink_ranks"):
        Tuning(norm_shrink_ranks=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        current().pdl = False
    assert all(f.type in (bool, int, float, tuple) or f.name == "medium" for f in dataclasses.fields(Tuning))


def test_import_kernels_without_triton():
    """With triton unimportable, `import kernels` works, available is False and every predicate says
    no; the trunk imports too (ops, the seam, and the sampler behind it)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, kernels\n"
            "assert kernels.available is False\n"
            "x = torch.zeros(2, 4)\n"
            "assert not kernels.runs(x) and not kernels.gemm_runs(x)\n"
            "assert not kernels.sampler_runs(False, (2, 4), 'cuda')\n"
            "assert not kernels.rope_fits(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))\n"
            "assert not kernels.lm_head_fits(x, torch.nn.Linear(4, 4, bias=False))\n"
            "assert kernels.current().pdl\n"
            "import ops, rollout\n"
            "assert not ops.attention_kernels('cpu') and not ops.runs(x)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_describe_names_every_fast_path_a_version_or_device_turns_off(monkeypatch):
    """The start-up line: on an sm_90 GPU with another Triton, the register-A kernel is off and the warning
    says why and how to get it (constraints-gpu.txt); on sm_80 PDL is off too; the CPU runs references."""
    if not kernels.available:
        line, warnings = kernels.describe("cuda")
        assert "Triton is not installed" in line and warnings
        return
    assert kernels.describe("cpu") == ("kernels: the CPU runs the torch references (Triton kernels need a CUDA "
                                       "device)", [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, il: False)
    monkeypatch.setattr(launch, "capability", lambda index: (9, 0))
    line, warnings = kernels.describe("cuda")
    assert "programmatic dependent launch" in line and "register-A" not in line and len(warnings) == 1
    assert "register-A wgmma kernel off" in warnings[0] and "constraints-gpu.txt" in warnings[0]
    monkeypatch.setattr(launch, "capability", lambda index: (8, 0))
    line, warnings = kernels.describe("cuda")
    assert "programmatic dependent launch" not in line and len(warnings) == 2 and "sm_80" in warnings[1]
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, il: True)
    monkeypatch.setattr(launch, "capability", lambda index: (9, 0))
    line, warnings = kernels.describe("cuda")
    assert "register-A wgmma kernel" in line and warnings == []
