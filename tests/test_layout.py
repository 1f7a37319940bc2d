"""The layout rules of DESIGN.md, read off the source with `ast` (nothing is imported):

- imports run one way: no import circle anywhere (top-level modules and the kernels/ package's
  modules, a package counting as its __init__), and no file under kernels/ imports a top-level
  module: the wing works on tensors and attributes handed to it;
- the trunk reaches the wing through one face: ops.py is the only top-level file that imports
  `kernels` (tests and benchmarks may reach in);
- the reading path stays readable: no function over MAX_LINES lines (its docstring not counted) and
  none with more than MAX_POSITIONAL positional parameters (self / cls / ctx and keyword-only ones
  not counted; a Triton kernel's pointer and size arguments are its launch grid's, so @triton.jit
  functions are exempt from that count).
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READING_PATH = ("nvfp4.py", "marlin_kernel.py", "aqn.py", "lora.py", "grpo.py", "model.py", "rollout.py",
                "graphs.py", "scheduler.py", "train.py")
MAX_LINES, MAX_POSITIONAL = 60, 6


def _modules() -> dict:
    """{module name: path} of the top-level files and the kernels/ package."""
    out = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for f in os.listdir(os.path.join(ROOT, "kernels")):
        if f.endswith(".py"):
            name = "kernels" if f == "__init__.py" else f"kernels.{f[:-3]}"
            out[name] = os.path.join(ROOT, "kernels", f)
    return out


def _imports(name: str, path: str, known: set) -> set:
    """The project modules `name` imports (anywhere in the file, lazy imports too)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:      # relative: inside kernels/
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = f"{base}.{node.module}" if node.module else base
            targets = ([module] if node.module else []) + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:       # a name imported from a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_wing_imports_nothing_of_the_trunk():
    graph = _graph()
    bad = {m: sorted(d for d in deps if not d.startswith("kernels"))
           for m, deps in graph.items() if m.startswith("kernels")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_ops_is_the_only_face():
    graph = _graph()
    assert sorted(m for m, deps in graph.items()
                  if not m.startswith("kernels") and any(d.startswith("kernels") for d in deps)) == ["ops"]


def test_the_checks_find_what_they_look_for():
    """The checks above on made-up graphs: a circle, a wing file importing the trunk."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    src = os.path.join(ROOT, "kernels", "stacked.py")
    assert "kernels.gemm" in _imports("kernels.stacked", src, set(_modules()))


def _too_long(path: str) -> list:
    """'file:line name (why)' for each function over the limits."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
        args = node.args.posonlyargs + node.args.args
        positional = len([a for a in args if a.arg not in ("self", "cls", "ctx")])
        jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
        where = f"{os.path.basename(path)}:{node.lineno} {node.name}"
        if lines > MAX_LINES:
            out.append(f"{where} ({lines} lines)")
        if positional > MAX_POSITIONAL and not jit:
            out.append(f"{where} ({positional} positional parameters)")
    return out


def test_reading_path_functions_are_short():
    assert [p for f in READING_PATH for p in _too_long(os.path.join(ROOT, f))] == []


def test_the_length_check_counts_what_it_says(tmp_path):
    """A function of MAX_LINES lines and six positional parameters passes, its docstring not counted;
    one line more, or a seventh positional parameter, is reported."""
    def body(n):
        return "".join(f"    x{i} = {i}\n" for i in range(n))
    f = tmp_path / "m.py"
    f.write_text(f'def ok(a, b, c, d, e, f, *, g=1):\n    """doc\n    doc"""\n{body(MAX_LINES - 1)}'
                 f"def long(self):\n{body(MAX_LINES)}"
                 "def wide(a, b, c, d, e, f, g):\n    pass\n")
    assert [p.split(" ", 1)[1] for p in _too_long(str(f))] == [
        f"long ({MAX_LINES + 1} lines)", "wide (7 positional parameters)"]
