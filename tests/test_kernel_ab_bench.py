"""bench/kernel_ab.py on CPU: another checkout's kernel stack loads beside this tree's without replacing it."""
import os
import shutil
import sys

import marlin_kernel
from test_step_bench import ROOT, load_bench


def test_base_tree_loads_its_own_modules_and_leaves_ours(tmp_path):
    ab = load_bench("kernel_ab")
    for name in ab.STACK:
        shutil.copy(os.path.join(ROOT, f"{name}.py"), tmp_path / f"{name}.py")
    with open(tmp_path / "fp4_decode.py", "a") as f:         # a mark only the other checkout has
        f.write("\nBASE_TREE_MARK = 1\n")
    ours = {name: sys.modules.get(name) for name in ab.STACK}

    base = ab.load_tree(str(tmp_path))

    # its marlin_kernel and the stack under it are the other checkout's files ...
    for mod in (base, base.rak, base.rad):
        assert os.path.dirname(mod.__file__) == str(tmp_path), mod.__file__
    assert "BASE_TREE_MARK" in base.rak.pdl_start.fn.__globals__     # fp4_decode, through register_a_kernel
    assert "BASE_TREE_MARK" in base.pdl_start.fn.__globals__         # ... and through marlin_kernel
    # ... while this tree's modules stay what they were
    assert base is not marlin_kernel and base.rak is not marlin_kernel.rak
    assert {name: sys.modules.get(name) for name in ab.STACK} == ours
    assert "BASE_TREE_MARK" not in marlin_kernel.pdl_start.fn.__globals__
