"""Same-run A/B of the NVFP4 matmul: this tree's kernels against another checkout's, in one process.

Why. bench/kernel.py times one tree; two of its runs differ by a few percent on a shared machine,
more than many kernel changes gain. Here both trees' kernel packages are loaded side by side (the
other checkout's `kernels` under the module name kernels_base, so its relative imports stay within
it), and for every (shape, M) the two routes and cuBLAS bf16 are timed in turn, --reps times, on the
same inputs and the same rotated weight copies, timed like bench/kernel.py (CUDA-graph replays,
median). Each output is also compared bit for bit: a change meant to leave the arithmetic alone (a
shorter decode, other addressing, a file moved) must give the same bits, and the table says where it
does not. A checkout from before the kernels/ package (its marlin_kernel.py and the kernel modules
beside it) loads too, so a layout change can be A/B'd against the tree it came from.

    git worktree add ../base main        # or any other checkout of the project
    python bench/kernel_ab.py --base ../base --ms 1,2,16,64,128,1024 --dx-ms 128,1024 --out DIR
    python bench/kernel_ab.py --base ../base --ms 2,8,16 --between     # a small kernel after every call

Prints a line per (shape, M) and writes DIR/kernel_ab.json: between (the flag), and rows of (shape,
M, op, base_us[], this_us[], cublas_us[], same_bits).
"""
import argparse
import importlib
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch

# a checkout from before kernels/: its kernel modules, loaded once per tree (each imports the others by these names)
FLAT = ("fp4_decode", "small_m_kernels", "tile_kernels", "register_a_kernel", "register_a_dx", "marlin_kernel")


def load_tree(root: str, name: str = "kernels_base"):
    """The kernel entry point of the checkout at root, beside this tree's: its `kernels` package as
    module `name` (its submodules name.gemm, ...), or, in a checkout without one, its marlin_kernel
    with the modules under it in module objects of their own. Either has nvfp4_matmul and
    nvfp4_matmul_dx taking interleaved=."""
    init = os.path.join(os.path.abspath(root), "kernels", "__init__.py")
    if os.path.exists(init):
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    saved = {m: sys.modules.pop(m) for m in FLAT if m in sys.modules}
    sys.path.insert(0, os.path.abspath(root))
    try:
        mk = importlib.import_module("marlin_kernel")
    finally:
        sys.path.pop(0)
        for m in FLAT:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
    return mk


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout's root directory")
    ap.add_argument("--shapes", default="all", help="comma-separated bench/kernel.py shape names, or all")
    ap.add_argument("--ms", default="1,2,4,8,16,64,128,256,1024", help="comma-separated M values")
    ap.add_argument("--dx-ms", default="", help="M values at which dx = dy·W is timed too (comma-separated)")
    ap.add_argument("--reps", type=int, default=2, help="times each of the three is timed, alternating")
    ap.add_argument("--between", action="store_true",
                    help="a small kernel after every call, as a layer's other ops follow a matmul in the decode "
                         "graph: back-to-back launches of one kernel under PDL can time unlike the graph; its "
                         "time is in every row, so compare this / base, not x")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_ab.py needs a CUDA GPU")
    base = load_tree(args.base)
    import kernel as kb                      # bench/kernel.py: weights, timing, copies (this tree)
    import kernels as this
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    dx_ms = {int(m) for m in args.dx_ms.split(",") if m}
    z = torch.zeros(4096, device=device)

    def followed(fn):
        """fn, then a one-wave elementwise kernel (z += 1): its time is in every row alike."""
        def run(*a):
            y = fn(*a)
            z.add_(1.0)
            return y
        return run

    names = list(kb.SHAPES) if args.shapes == "all" else args.shapes.split(",")
    print(f"# {torch.cuda.get_device_name(device)}; base = {os.path.abspath(args.base)}; us, CUDA-graph medians; "
          f"x = cuBLAS bf16 / route{'; a small kernel after every call' if args.between else ''}", flush=True)
    rows = []
    for name in names:
        N, K = kb.SHAPES[name]
        qs = kb.Rotating([kb.shipped_weight(N, K, device, gen) for _ in range(kb.copies_for(N * K * 4.5 / 8, device))])
        ws = kb.Rotating([torch.randn(N, K, device=device, generator=gen).bfloat16()
                          for _ in range(kb.copies_for(N * K * 2, device))])
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
            ops = [("fwd", lambda mk, w: mk.nvfp4_matmul(x, *w, interleaved=True), lambda: x @ ws.next().t())]
            if M in dx_ms:
                ops.append(("dx", lambda mk, w: mk.nvfp4_matmul_dx(dy, *w, interleaved=True), lambda: dy @ ws.next()))
            if args.between:
                ops = [(op, followed(fn), followed(cublas)) for op, fn, cublas in ops]
            for op, fn, cublas in ops:
                same = torch.equal(fn(base, qs.items[0]), fn(this, qs.items[0]))
                r = dict(shape=name, M=M, op=op, base_us=[], this_us=[], cublas_us=[], same_bits=same)
                for _ in range(args.reps):
                    r["base_us"].append(kb.bench_ms(lambda: fn(base, qs.next())) * 1e3)
                    r["this_us"].append(kb.bench_ms(lambda: fn(this, qs.next())) * 1e3)
                    r["cublas_us"].append(kb.bench_ms(cublas) * 1e3)
                b, t, c = (min(r[k]) for k in ("base_us", "this_us", "cublas_us"))
                print(f"{name:>11} M={M:5d} {op:>3}: base {'/'.join(f'{v:.1f}' for v in r['base_us'])} "
                      f"this {'/'.join(f'{v:.1f}' for v in r['this_us'])} cuBLAS {c:.1f} | this/base {t / b:.3f} "
                      f"x {c / b:.2f} -> {c / t:.2f}{'' if same else ' | BITS DIFFER'}", flush=True)
                rows.append(r)
        del qs, ws
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_ab.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(device), base=os.path.abspath(args.base),
                       between=args.between, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
