"""bench/results/ holds only what the documents cite: every file there is named by README.md,
kernels/README.md, docs/usage.md or a bench/*.py file (a glob written as bench/results/<pattern>,
such as the README's learn_smollm2_*, counts for the files it matches), there are at most 30, no
name carries an iteration tag (_v12_), every results file a document names exists, and each file is
plain data (JSON, JSON lines, UTF-8 text or PNG; no pickles). Older results live in git history."""
import fnmatch
import glob
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MAX_FILES = 30


def documents():
    paths = [os.path.join(ROOT, p) for p in ("README.md", os.path.join("kernels", "README.md"),
                                             os.path.join("docs", "usage.md"))]
    paths += sorted(glob.glob(os.path.join(ROOT, "bench", "*.py")))
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in paths}


def results():
    return sorted(f for f in os.listdir(RESULTS) if not f.startswith("."))


def cited(name, texts):
    """Named outright (not as part of a longer name), or matched by a bench/results/<glob>."""
    named = re.compile(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])")
    globs = [g for t in texts for g in re.findall(r"bench/results/([\w.\-]*\*[\w.*\-]*)", t)]
    return any(named.search(t) for t in texts) or any(fnmatch.fnmatchcase(name, g) for g in globs)


def test_every_result_is_cited():
    texts = list(documents().values())
    uncited = [f for f in results() if not cited(f, texts)]
    assert not uncited, (f"bench/results/ files that no document cites (README.md, kernels/README.md, "
                         f"docs/usage.md, bench/*.py): cite them or delete them: {uncited}")


def test_few_files_without_iteration_tags():
    files = results()
    assert len(files) <= MAX_FILES, f"bench/results/ holds {len(files)} files, at most {MAX_FILES}"
    tagged = [f for f in files if re.search(r"_v\d+_", f)]
    assert not tagged, f"iteration tags in bench/results/ names (name what and where instead): {tagged}"


def test_cited_results_exist():
    """A name a document gives for a results file (bench/results/<name>, or a bare *_h100.json-style
    name) is a file there, or a glob that matches one."""
    files = results()
    missing = []
    for doc, text in documents().items():
        names = re.findall(r"bench/results/([\w.*\-]+\.(?:json|jsonl|txt|png)|[\w.\-]*\*[\w.*\-]*)", text)
        names += re.findall(r"(?<![\w/.-])([\w\-]+_h[12]00[\w\-]*\.(?:json|jsonl|txt|png))", text)
        missing += [(doc, n) for n in names if not fnmatch.filter(files, n)]
    assert not missing, f"documents cite results files that do not exist: {missing}"


def test_results_are_plain_data():
    for f in results():
        path = os.path.join(RESULTS, f)
        data = open(path, "rb").read()
        if f.endswith(".json"):
            json.loads(data.decode("utf-8"))
        elif f.endswith(".jsonl"):
            [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
        elif f.endswith(".txt"):
            data.decode("utf-8")
        elif f.endswith(".png"):
            assert data.startswith(b"\x89PNG\r\n\x1a\n"), f"{f} is not a PNG"
        else:
            raise AssertionError(f"bench/results/{f}: not .json, .jsonl, .txt or .png")
