"""bench/kernel_ab.py on CPU: another checkout's kernels load beside this tree's without replacing
them, as a package (kernels/) or as the flat modules of a checkout from before it."""
import os
import shutil
import sys

import kernels
from test_kernel_bench import ROOT, load_bench


def test_base_tree_loads_its_own_package_and_leaves_ours(tmp_path):
    ab = load_bench("kernel_ab")
    shutil.copytree(os.path.join(ROOT, "kernels"), tmp_path / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "kernels" / "fp4_decode.py", "a") as f:      # a mark only the other checkout has
        f.write("\nBASE_TREE_MARK = 1\n")
    ours = {name: mod for name, mod in sys.modules.items() if name == "kernels" or name.startswith("kernels.")}

    base = ab.load_tree(str(tmp_path), name="kernels_test_base")
    try:
        # its package and the modules under it are the other checkout's files ...
        for mod in (base, base.gemm, base.register_a, base.tuning):
            assert os.path.dirname(mod.__file__) == str(tmp_path / "kernels"), mod.__file__
        assert "BASE_TREE_MARK" in base.register_a.pdl_start.fn.__globals__     # fp4_decode, through register_a
        assert base.gemm.tuning is base.tuning and base.tuning is not kernels.tuning
        assert callable(base.nvfp4_matmul) and callable(base.nvfp4_matmul_dx)
        # ... while this tree's modules stay what they were
        assert base is not kernels and base.gemm is not kernels.gemm
        assert {name: mod for name, mod in sys.modules.items()
                if name == "kernels" or name.startswith("kernels.")} == ours
        assert "BASE_TREE_MARK" not in kernels.register_a.pdl_start.fn.__globals__
    finally:
        for name in [n for n in sys.modules if n.startswith("kernels_test_base")]:
            del sys.modules[name]


def test_a_checkout_from_before_the_package_loads_its_marlin_kernel(tmp_path):
    """Without kernels/, load_tree imports the checkout's marlin_kernel (and the modules it imports by
    their flat names) in module objects of their own, and puts back the ones of those names it found."""
    ab = load_bench("kernel_ab")
    (tmp_path / "fp4_decode.py").write_text("MARK = 'base'\n")
    (tmp_path / "marlin_kernel.py").write_text("import fp4_decode\n\ndef nvfp4_matmul(*a, **k):\n    return 'base'\n")
    before = sys.modules.get("marlin_kernel")
    mk = ab.load_tree(str(tmp_path))
    assert mk.nvfp4_matmul() == "base" and mk.fp4_decode.MARK == "base"
    assert os.path.dirname(mk.__file__) == str(tmp_path)
    assert sys.modules.get("marlin_kernel") is before and sys.modules.get("fp4_decode") is not mk.fp4_decode
