"""tools/probe_files.py: the probes of tools/probe_integrity.py that damage files: a train.py
checkpoint given to eval.py and export.py (`checkpoint`), the same and the run's other files met by
--resume (`resume`), a model directory (`model`) and a dataset (`data`). Also the shape of a probe
(`Probe`) and the fixture every class starts from (`Bench`: a run with one checkpoint, made as train.py
makes it). Each damage is applied to a fresh copy.
"""
import argparse
import json
import os
import pickle
import random
import shutil
import sys
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import eval as qeval  # noqa: E402
import export  # noqa: E402
import flags  # noqa: E402
import lora  # noqa: E402
import run_dir  # noqa: E402
from checkpoint import load_model  # noqa: E402

CKPT = "checkpoint-000003"


@dataclass
class Probe:
    cls: str                          # its row in the table
    name: str
    run: Callable[[], object]         # the action; its return value goes to `check`
    expect: str = "refuse"            # refuse | accept | warn
    clean: tuple = (SystemExit,)      # exceptions that count as a clean refusal (one line)
    check: Callable | None = None     # for accept: the result -> None if right, else what is wrong
    marker: str | None = None         # a file planted code would create
    limit_s: float = 120.0


# ----------------------------------------------------------------------------------------------
# damage


def flip_bit(path, at):
    data = bytearray(open(path, "rb").read())
    data[at % len(data)] ^= 0x10
    open(path, "wb").write(bytes(data))


def truncate(path, keep):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep(len(data))])


def garble(path, n=64, seed=0):
    data = bytearray(open(path, "rb").read())
    at = random.Random(seed).randrange(0, max(1, len(data) - n))
    data[at:at + n] = bytes((b + 1) % 256 for b in data[at:at + n])
    open(path, "wb").write(bytes(data))


def replace_with_dir(path):
    os.remove(path)
    os.mkdir(path)


# name -> damage(path) of one file: the ways a disk, a copy or a hand break a file
FILE_DAMAGE = {
    "one bit flipped mid-file": lambda p: flip_bit(p, os.path.getsize(p) // 2),
    "one bit flipped in the first bytes": lambda p: flip_bit(p, 3),
    "one bit flipped in the last byte": lambda p: flip_bit(p, -1),
    "64 bytes garbled": garble,
    "cut to half": lambda p: truncate(p, lambda n: n // 2),
    "emptied": lambda p: truncate(p, lambda n: 0),
    "16 bytes appended": lambda p: open(p, "ab").write(b"\0" * 16),
    "deleted": os.remove,
    "replaced by a directory": replace_with_dir,
}
CHECKPOINT_FILES = (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, run_dir.TRAINER_STATE, run_dir.MANIFEST)


def remanifest(ckpt):
    """Rewrite the manifest to match what is there now: a consistent forgery, which only the loaders'
    own checks can refuse."""
    with open(os.path.join(ckpt, run_dir.MANIFEST)) as f:
        step = json.load(f).get("step")
    config = os.path.join(os.path.dirname(ckpt), run_dir.RUN_CONFIG)
    run_dir.write_manifest(ckpt, step=step, **{run_dir.RUN_CONFIG: run_dir._sha256(config)})


def edit_tensors(ckpt, edit):
    path = os.path.join(ckpt, lora.ADAPTER_WEIGHTS)
    tensors = load_file(path)
    save_file(edit(tensors), path, metadata={"format": "pt"})


def edit_config(ckpt, **changes):
    path = os.path.join(ckpt, lora.ADAPTER_CONFIG)
    config = json.load(open(path))
    config.update(changes)
    open(path, "w").write(json.dumps(config))


class Planted:
    """A pickle that runs code when loaded: what trainer_state.pt must never be able to do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# forged-but-consistent adapters (the manifest rewritten to match): name -> damage(checkpoint dir)
FORGED = {
    "NaN in lora_B": lambda c: edit_tensors(c, lambda t: {k: v.fill_(float("nan")) if "lora_B" in k else v
                                                          for k, v in t.items()}),
    "tensors stored as int32": lambda c: edit_tensors(c, lambda t: {k: v.to(torch.int32) for k, v in t.items()}),
    "one tensor missing": lambda c: edit_tensors(c, lambda t: dict(list(t.items())[1:])),
    "no tensors at all": lambda c: edit_tensors(c, lambda t: {}),
    "r in the config is 6": lambda c: edit_config(c, r=6),
    "r in the config is a billion": lambda c: edit_config(c, r=10 ** 9),
    "lora_alpha NaN": lambda c: edit_config(c, lora_alpha=float("nan")),
    "another base model": lambda c: edit_config(c, base_model_name_or_path="Qwen/Qwen2.5-7B-Instruct"),
    "target_modules a string": lambda c: edit_config(c, target_modules="q_proj"),
    "config a JSON list": lambda c: open(os.path.join(c, lora.ADAPTER_CONFIG), "w").write("[1, 2]"),
}


# ----------------------------------------------------------------------------------------------
# the fixtures: a run with one checkpoint


@dataclass
class Bench:
    model: str
    work: str
    run: str = ""
    ckpt: str = ""
    count: int = 0

    def fresh(self, what="run", dst=None) -> str:
        """A private copy of the pristine run (or of the model directory), at dst or a new name."""
        self.count += 1
        dst = dst or os.path.join(self.work, f"{what}-{self.count}")
        shutil.copytree(self.run if what == "run" else self.model, dst, symlinks=True)
        return dst


def make_run(bench: Bench) -> None:
    """<work>/pristine: run_config.json (flags.py's own), checkpoint-000003 (a random r=4 adapter, one
    AdamW step of state, saved by run_dir.save_checkpoint as train.py saves it) and metrics.jsonl's rows
    of steps 0-2."""
    run = os.path.join(bench.work, "pristine")
    os.makedirs(run)
    args = flags.parse_args(["--model", bench.model, "--output-dir", run, "--dataset", "addition", "--quant", "bf16",
                             "--lora-rank", "4",
                             "--dtype", "float32", "--max-new-tokens", "4", "--eval-limit", "0"])
    run_dir.write_atomic(os.path.join(run, run_dir.RUN_CONFIG), json.dumps(vars(args), indent=2))
    model = load_model(bench.model, quant="bf16", device="cpu", dtype=torch.float32)
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8), generator=torch.Generator().manual_seed(0))
    params = lora.lora_parameters(model)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run_dir.save_checkpoint(run, 3, model, optimizer, scheduler, 6, bench.model, keep=3)
    with open(os.path.join(run, run_dir.METRICS), "w") as f:   # the rows of steps 0-2, before the checkpoint
        f.writelines(json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in range(3))
    bench.run, bench.ckpt = run, os.path.join(run, CKPT)


def eval_argv(bench, adapter):
    return ["--model", bench.model, "--adapter", adapter, "--dataset", "addition", "--limit", "1",
            "--max-new-tokens", "2", "--dtype", "float32"]


def export_argv(bench, adapter):
    return ["--model", bench.model, "--adapter", adapter, "--out", os.path.join(bench.work, f"export-{bench.count}"),
            "--formats", "adapter"]


# ----------------------------------------------------------------------------------------------
# the classes


def checkpoint_probes(bench: Bench) -> list[Probe]:
    probes = []

    def damaged(file, damage):
        def run(tool):
            ckpt = os.path.join(bench.fresh(), CKPT)
            damage(os.path.join(ckpt, file))
            return tool.main(eval_argv(bench, ckpt) if tool is qeval else export_argv(bench, ckpt))
        return run

    for tool in (qeval, export):
        for file in CHECKPOINT_FILES:
            for name, damage in FILE_DAMAGE.items():
                run = damaged(file, damage)
                probes.append(Probe("checkpoint", f"{tool.__name__}: {file} {name}", lambda run=run, t=tool: run(t)))
        for name, forge in FORGED.items():
            def run(forge=forge, t=tool):
                ckpt = os.path.join(bench.fresh(), CKPT)
                forge(ckpt)
                remanifest(ckpt)
                return t.main(eval_argv(bench, ckpt) if t is qeval else export_argv(bench, ckpt))
            probes.append(Probe("checkpoint", f"{tool.__name__}: forged, manifest rewritten: {name}", run))

    def peft(damage=None):   # the checkpoint's adapter files alone, outside any run: a PEFT adapter
        dst = os.path.join(bench.work, f"peft-{bench.count}")
        bench.count += 1
        os.makedirs(dst)
        for f in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG):
            shutil.copy(os.path.join(bench.ckpt, f), dst)
        if damage:
            damage(dst)
        return dst

    # the config cut, not garbled: 8 garbled bytes may land inside a key's name and leave valid JSON,
    # which the loader rightly reads (an unknown key is a newer PEFT's)
    for name, damage in {"config not JSON": lambda d: truncate(os.path.join(d, lora.ADAPTER_CONFIG), lambda n: n // 2),
                         "weights header damaged": lambda d: flip_bit(os.path.join(d, lora.ADAPTER_WEIGHTS), 3),
                         "weights cut": lambda d: truncate(os.path.join(d, lora.ADAPTER_WEIGHTS), lambda n: n - 100),
                         **{k: v for k, v in FORGED.items() if k in ("NaN in lora_B", "r in the config is a billion",
                                                                       "tensors stored as int32")}}.items():
        probes.append(Probe("checkpoint", f"eval: a PEFT adapter without manifest, {name}",
                            lambda damage=damage: qeval.main(eval_argv(bench, peft(damage)))))
    for name, where in {f"{CKPT} without manifest or trainer_state.pt, beside run_config.json":
                        lambda: _without_manifest(bench.fresh())}.items():
        probes.append(Probe("checkpoint", f"eval: {name}", lambda where=where: qeval.main(eval_argv(bench, where()))))
    # controls: what must keep working
    probes.append(Probe("checkpoint", "eval: the pristine checkpoint", lambda: qeval.main(eval_argv(bench, bench.ckpt)),
                        expect="accept", check=lambda m: None if "accuracy" in m else "no accuracy"))
    probes.append(Probe("checkpoint", "eval: a PEFT adapter without manifest", lambda: qeval.main(eval_argv(bench, peft())),
                        expect="accept", check=lambda m: None if "accuracy" in m else "no accuracy"))
    probes.append(Probe("checkpoint", "export: a failed --overwrite keeps the previous export",
                        lambda: _failed_overwrite(bench), expect="accept", check=lambda wrong: wrong))
    return probes


def _without_manifest(run):
    os.remove(os.path.join(run, CKPT, run_dir.MANIFEST))
    os.remove(os.path.join(run, CKPT, run_dir.TRAINER_STATE))
    return os.path.join(run, CKPT)


def _failed_overwrite(bench):
    """Export, then --overwrite from a forged adapter (refused after the base loaded): the first export
    must be byte for byte as it was. Returns what is wrong, or None."""
    out = os.path.join(bench.work, f"overwrite-{bench.count}")
    argv = ["--model", bench.model, "--out", out, "--formats", "adapter,merged"]
    export.main([*argv, "--adapter", bench.ckpt])
    before = {f: open(os.path.join(r, f), "rb").read() for r, _, fs in os.walk(out) for f in fs}
    ckpt = os.path.join(bench.fresh(), CKPT)
    FORGED["NaN in lora_B"](ckpt)
    remanifest(ckpt)
    try:
        export.main([*argv, "--adapter", ckpt, "--overwrite"])
        return "the forged adapter was exported"
    except SystemExit:
        pass
    after = {f: open(os.path.join(r, f), "rb").read() for r, _, fs in os.walk(out) for f in fs}
    return None if after == before else "the previous export changed"


def resume(bench, out):
    """What train.py does with --resume, short of training: the directory, the checkpoint, the records."""
    ckpt = run_dir.prepare_output_dir(argparse.Namespace(output_dir=out, resume=True))
    try:
        model = load_model(bench.model, quant="bf16", device="cpu", dtype=torch.float32)
        lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8))
        optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        state = run_dir.load_checkpoint(ckpt, model, optimizer, scheduler, bench.model)
        for name in (run_dir.METRICS, run_dir.COMPLETIONS):
            run_dir.truncate_rows(out, name, state["step"])
    finally:
        run_dir.unlock_run_dir(out)
    return state


def resume_probes(bench: Bench) -> list[Probe]:
    probes = []
    for file in CHECKPOINT_FILES:
        for name, damage in FILE_DAMAGE.items():
            def run(file=file, damage=damage):
                out = bench.fresh()
                damage(os.path.join(out, CKPT, file))
                return resume(bench, out)
            probes.append(Probe("resume", f"{file} {name}", run))

    def forged(change, expect="refuse", marker=None, name=""):
        def run():
            out = bench.fresh()
            change(out, os.path.join(out, CKPT))
            return resume(bench, out)
        return Probe("resume", name, run, expect=expect, marker=marker)

    marker = os.path.join(bench.work, "pickle-ran")

    def state(ckpt, edit):
        path = os.path.join(ckpt, run_dir.TRAINER_STATE)
        torch.save(edit(torch.load(path, weights_only=True)), path)
        remanifest(ckpt)

    def pickled(ckpt):
        with open(os.path.join(ckpt, run_dir.TRAINER_STATE), "wb") as f:
            pickle.dump({"step": 1, "x": Planted(marker)}, f)
        remanifest(ckpt)

    def nan_state(s):
        for v in s["optimizer"]["state"].values():
            v["exp_avg"].fill_(float("nan"))
        return s

    def write(path, text):
        with open(path, "w") as f:
            f.write(text)

    def metrics_edit(out, edit):
        path = os.path.join(out, run_dir.METRICS)
        lines = open(path).read().splitlines(keepends=True)
        open(path, "w").write("".join(edit(lines)))

    def manifest_escape(ckpt):
        path = os.path.join(ckpt, run_dir.MANIFEST)
        m = json.load(open(path))
        m["files"]["../run_config.json"] = {"size": 1, "sha256": "0" * 64}
        open(path, "w").write(json.dumps(m))

    probes += [
        forged(lambda o, c: pickled(c), marker=marker, name="trainer_state.pt: a pickle that runs code, manifest rewritten"),
        forged(lambda o, c: state(c, lambda s: {k: v for k, v in s.items() if k != "optimizer"}),
               name="trainer_state.pt without optimizer state, manifest rewritten"),
        forged(lambda o, c: state(c, lambda s: {**s, "step": 7}), name="trainer_state.pt of another step, manifest rewritten"),
        forged(lambda o, c: state(c, nan_state), name="optimizer state NaN, manifest rewritten"),
        forged(lambda o, c: state(c, lambda s: {**s, "optimizer": {"state": {}, "param_groups": []}}),
               name="optimizer state of another model, manifest rewritten"),
        forged(lambda o, c: state(c, lambda s: [1, 2]), name="trainer_state.pt a list, manifest rewritten"),
        forged(lambda o, c: write(os.path.join(o, run_dir.RUN_CONFIG),
                                  open(os.path.join(o, run_dir.RUN_CONFIG)).read().replace('"lr": 1e-05', '"lr": 1e-03')),
               name="run_config.json edited after the checkpoint"),
        forged(lambda o, c: (os.remove(os.path.join(o, run_dir.LOCK)) if os.path.exists(os.path.join(o, run_dir.LOCK))
                             else None, os.mkdir(os.path.join(o, run_dir.LOCK))), name=".lock is a directory"),
        forged(lambda o, c: manifest_escape(c), name="manifest lists ../run_config.json"),
        forged(lambda o, c: (shutil.rmtree(c), os.symlink(bench.ckpt, c)), name="checkpoint is a link to another run's"),
        forged(lambda o, c: metrics_edit(o, lambda ls: ls[:1] + [ls[1][:5] + "\xff\n"] + ls[2:]),
               name="metrics.jsonl: a garbled line before the resumed step"),
        forged(lambda o, c: write(os.path.join(o, run_dir.LATEST), "../elsewhere/checkpoint-000009"), expect="warn",
               name="latest points outside the run"),
        forged(lambda o, c: os.remove(os.path.join(o, run_dir.METRICS)), expect="warn", name="metrics.jsonl deleted"),
        forged(lambda o, c: metrics_edit(o, lambda ls: ls[:1] + ls[2:]), expect="warn",
               name="metrics.jsonl: a row deleted"),
        forged(lambda o, c: metrics_edit(o, lambda ls: ls[:2] + [ls[2][:7]]), expect="warn",
               name="metrics.jsonl: its last line cut"),
        forged(lambda o, c: metrics_edit(o, lambda ls: ls[:2] + ls[1:]), expect="warn",
               name="metrics.jsonl: a row duplicated"),
    ]
    probes.append(Probe("resume", "the pristine run", lambda: resume(bench, bench.fresh()), expect="accept",
                        check=lambda s: None if s["step"] == 3 else f"resumed at step {s['step']}"))
    return probes


def model_probes(bench: Bench) -> list[Probe]:
    def damaged(edit):
        def run():
            path = bench.fresh("model")
            edit(path)
            return qeval.main(["--model", path, "--dataset", "addition", "--limit", "1", "--max-new-tokens", "2",
                               "--dtype", "float32"])
        return run

    def config(**changes):
        def edit(path):
            c = json.load(open(os.path.join(path, "config.json")))
            c.update(changes)
            open(os.path.join(path, "config.json"), "w").write(json.dumps(c))
        return edit

    def sharded(weight_map_file):
        def edit(path):
            keys = load_file(os.path.join(path, "model.safetensors")).keys()
            os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00001.safetensors"))
            open(os.path.join(path, "model.safetensors.index.json"), "w").write(
                json.dumps({"weight_map": {k: weight_map_file for k in keys}}))
            shutil.copy(os.path.join(path, "model-00001-of-00001.safetensors"), os.path.join(bench.work, "outside.safetensors"))
        return edit

    def template(text):
        def edit(path):
            open(os.path.join(path, "chat_template.jinja"), "w").write(text)
            c = os.path.join(path, "tokenizer_config.json")
            cfg = json.load(open(c))
            cfg.pop("chat_template", None)
            open(c, "w").write(json.dumps(cfg))
        return edit

    def remove(*names):
        return lambda path: [os.remove(os.path.join(path, n)) for n in names if os.path.exists(os.path.join(path, n))]

    cases = {
        "num_attention_heads 0": config(num_attention_heads=0),
        "num_attention_heads missing": lambda p: (config()(p), _drop_key(p, "num_attention_heads")),
        "hidden_size a string": config(hidden_size="big"),
        "an unsupported architecture": config(architectures=["GPT2LMHeadModel"]),
        "config.json not JSON": lambda p: garble(os.path.join(p, "config.json"), n=8),
        "config.json a list": lambda p: open(os.path.join(p, "config.json"), "w").write("[]"),
        "no config.json": remove("config.json"),
        "no tokenizer": remove("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
        "model.safetensors header damaged": lambda p: flip_bit(os.path.join(p, "model.safetensors"), 2),
        "model.safetensors cut": lambda p: truncate(os.path.join(p, "model.safetensors"), lambda n: n // 2),
        "model.safetensors deleted": remove("model.safetensors"),
        "only pickle weights": lambda p: (os.rename(os.path.join(p, "model.safetensors"), os.path.join(p, "pytorch_model.bin"))),
        "index points to ../outside.safetensors": sharded("../outside.safetensors"),
        "index points to sub/../../outside.safetensors": sharded("sub/../../outside.safetensors"),
        "index points to an absolute path": sharded(os.path.join(bench.work, "outside.safetensors")),
        "index names a missing shard": sharded("model-00009-of-00009.safetensors"),
        "index not JSON": lambda p: (sharded("model-00001-of-00001.safetensors")(p),
                                     truncate(os.path.join(p, "model.safetensors.index.json"), lambda n: n // 2)),
        "chat template that raises": template("{{ raise_exception('no chat for you') }}"),
        "chat template with a syntax error": template("{% for m in messages %}{{ m.content "),
        "chat template that calls what the sandbox forbids": template("{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    }
    return [Probe("model", name, damaged(edit)) for name, edit in cases.items()]


def _drop_key(path, key):
    c = json.load(open(os.path.join(path, "config.json")))
    c.pop(key)
    open(os.path.join(path, "config.json"), "w").write(json.dumps(c))


def data_probes(bench: Bench) -> list[Probe]:
    def load(text, ext=".jsonl", mode="w"):
        def run():
            bench.count += 1
            path = os.path.join(bench.work, f"data-{bench.count}{ext}")
            open(path, mode).write(text)
            return qeval.main(["--model", bench.model, "--dataset", path, "--limit", "1", "--max-new-tokens", "2",
                               "--dtype", "float32"])
        return run

    def rows(*recs):
        return "".join(json.dumps(r) + "\n" for r in recs)

    good = {"question": "1 + 1?", "answer": "2"}
    cases = {
        "an empty prompt": rows(good, {"question": "", "answer": "2"}),
        "a whitespace prompt": rows({"question": " \n\t", "answer": "2"}),
        "a system-only conversation": rows({"prompt": [{"role": "system", "content": "Be brief."}], "answer": "2"}),
        "a conversation whose user turn is blank": rows({"prompt": [{"role": "user", "content": "  "}], "answer": "2"}),
        "an empty answer": rows(good, {"question": "2 + 2?", "answer": ""}),
        "an answer that is only ####": rows({"question": "2 + 2?", "answer": "Four.\n####"}),
        "a NaN answer": rows({"question": "2 + 2?", "answer": float("nan")}),
        "a null answer": rows({"question": "2 + 2?", "answer": None}),
        "a CSV with an empty answer cell": ("question,answer\n1 + 1?,2\n2 + 2?,\n", ".csv"),
        "a CSV that does not parse": ('question,answer\n"1+1,2\n1,2,3\n', ".csv"),
        "bytes that are not UTF-8": (b'{"question": "caf\xe9?", "answer": "3"}\n', ".jsonl", "wb"),
        "a malformed JSON line": rows(good) + '{"question": "x", "answer": \n',
        "an empty file": "",
        "no prompt column": rows({"text": "1 + 1?", "answer": "2"}),
        "a prompt that is a number": rows({"question": 12, "answer": "2"}),
    }
    return [Probe("data", name, load(*(case if isinstance(case, tuple) else (case,)))) for name, case in cases.items()]
