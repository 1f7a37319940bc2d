"""The run directory: the arguments, the metrics, the checkpoints, the plots, and one writer at a time.

    <output-dir>/run_config.json        the flags of the run (--resume reads them: flags.py)
                 metrics.jsonl          one JSON line per step (numbered from 1, as on screen), TRL's
                                        metric names where they exist
                 completions.jsonl      a few of each step's completions with their rewards (report.py)
                 plots.png              reward, eval accuracy, loss, grad norm, AQN σ, step time, entropy
                                        and completion length against step, redrawn at each evaluation
                 checkpoint-<step>/     adapter_model.safetensors + adapter_config.json (a PEFT adapter)
                                        + trainer_state.pt (optimizer, schedule, step, data position,
                                        dynamic sampling's keep rate)
                                        + manifest.json (the size and sha256 of each of those files,
                                        and of run_config.json)
                 base/                  --quantizer gptq (an NVFP4 run's default): the NVFP4 base the
                                        run trains on (its codes depend on the calibration prompts, so
                                        --resume, eval.py and export.py read it here rather than
                                        quantize again) + manifest.json
                 latest                 the name of the newest checkpoint: a hint, not the truth
                 .lock                  held by the live run (flock); it holds the run's pid and host

One writer. A run holds an exclusive flock on .lock for its whole life; the kernel drops it when the
process ends, however it ends (a kill -9 included), so a lock is never stale. A second run on the
directory, fresh or --resume, finds it held and stops before it reads or writes anything else, with
the holder's pid and host in the message.

Crash safety. Every file is written under a temporary name, flushed to disk and renamed; a checkpoint
is written as the directory .tmp-checkpoint-<step>, its manifest last, and renamed whole; only then
does `latest` name it. A run killed while writing its first run_config.json leaves only the .tmp file,
and the directory counts as empty. Nothing non-finite is written: save_checkpoint refuses an adapter
or optimizer tensor holding NaN or Inf (the run stops there, naming it, and the previous checkpoint
stays the newest).

Trust. --resume takes the newest checkpoint inside the directory whose manifest verifies (every
file's size and sha256, and the sha256 of the run's run_config.json when the checkpoint was written:
a run_config.json edited or damaged since is refused), whatever `latest` says: a `latest` that is
missing, names a checkpoint that does not verify, or points outside the directory is reported and
passed over. A directory whose checkpoints all fail is refused with each one's reason, and nothing is
changed. Resuming never deletes a checkpoint newer than the one it resumed from (one that failed
verification is moved aside under a .unverified-* name when the run writes that step again), and
metrics.jsonl keeps every row up to the checkpoint's step (completions.jsonl too); a row of those steps
that is missing or repeated (a file deleted, cut or copied over) is said on screen. Loading refuses
non-finite values too, naming the tensor. trainer_state.pt is read with torch.load(weights_only=True):
tensors and numbers, never code; a file that is not that, or whose state does not fit, is one line.
eval.py and export.py verify an --adapter by the same manifest (`verify_adapter`).

Test: tests/test_run_dir.py (lock, manifest, resume choice, metrics); tests/test_integrity.py (two
runs at once, kill -9 at random instants, bad input, end to end); tests/test_train.py (resume);
tests/test_probes.py (damaged checkpoints, run files and adapters).
"""
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time

import torch

import lora

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
COMPLETIONS = "completions.jsonl"
LATEST = "latest"
LOCK = ".lock"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
BASE = "base"               # a --quantizer gptq run's NVFP4 base, as checkpoint.save_pretrained writes it
CALIBRATION_PROMPTS = 128   # GPTQ's calibration: the run's first training prompts, in its data order
# What a fresh run may find in its directory: a run killed before its first run_config.json landed.
LEFTOVERS = {LOCK, RUN_CONFIG + ".tmp", BASE, ".tmp-" + BASE}   # a start killed before run_config.json

_held = {}  # realpath of a run directory -> the open .lock this process holds (closing it unlocks)


# ----------------------------------------------------------------------------------------------
# the lock


def lock_run_dir(out: str) -> None:
    """Take the directory's exclusive lock for this process's life, or stop naming who holds it.
    A later call in the same process (a second train.main in one Python) takes it over."""
    key = os.path.realpath(out)
    if key in _held:
        _held.pop(key).close()
    path = os.path.join(out, LOCK)
    try:
        f = open(path, "a+")  # never truncated before the lock is ours
    except OSError as e:
        fix = "remove it" if os.path.isdir(path) else "fix its permissions"
        raise SystemExit(f"error: cannot open {path} ({e.strerror}): a run keeps its lock in that file; {fix}") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its pid yet"
        f.close()
        raise SystemExit(f"error: {out} is in use by another run ({holder}); wait for it to end, or choose "
                         f"another --output-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held[key] = f


def unlock_run_dir(out: str) -> None:
    f = _held.pop(os.path.realpath(out), None)
    if f is not None:
        f.close()


# ----------------------------------------------------------------------------------------------
# files


def write_atomic(path: str, text: str) -> None:
    """Write under a temporary name, flush to disk, rename: readers see the old or the new file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:  # a rename is durable once its directory is on disk
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_rows(path: str) -> list[tuple[object, str]]:
    """[(row, its line)] of a JSONL file (blank lines skipped), stopping with path:line on a line that
    is not UTF-8 or not JSON; a last line without its newline (cut by a kill mid-write) is dropped."""
    out = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SystemExit(f"error: {path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                             f"fix or remove that line") from None
        try:
            out.append((json.loads(text), text))
        except json.JSONDecodeError as e:
            if lineno == len(lines):  # no newline after it: the write was cut
                break
            raise SystemExit(f"error: {path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                             f"fix or remove that line") from None
    return out


# ----------------------------------------------------------------------------------------------
# the directory at start


def prepare_output_dir(args, write: bool = True) -> str | None:
    """Check (and, if write, lock and create) the output directory; return the checkpoint to resume from.

    A directory that holds another run is never overwritten: without --resume that is an error (with
    it, flags.py has already refused any flag that differs from the run's). Every rank checks; rank 0
    (write) holds the lock and says what it chose. A refusal changes nothing."""
    out = args.output_dir
    say = print if write else (lambda *a, **k: None)
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"error: --output-dir {out} is a file, not a directory")
    found = set(os.listdir(out)) if os.path.isdir(out) else set()
    if found - LEFTOVERS and RUN_CONFIG not in found:
        raise SystemExit(f"error: {out} is not empty and holds no qerl run ({RUN_CONFIG} missing); "
                         f"choose another --output-dir")
    if write:
        os.makedirs(out, exist_ok=True)
        lock_run_dir(out)  # from here on, no other run changes the directory
    try:
        ckpt = _check_run(args, say)
    except BaseException:
        if write:
            unlock_run_dir(out)
        raise
    if write:
        for name in os.listdir(out):  # half-written checkpoints of a killed run
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    return ckpt


def _check_run(args, say) -> str | None:
    out = args.output_dir
    cfg_path = os.path.join(out, RUN_CONFIG)
    if not os.path.exists(cfg_path):
        if args.resume:
            say(f"--resume: {out} holds no run yet; starting one")
        return None
    if not args.resume:
        raise SystemExit(f"error: {out} already holds a run ({RUN_CONFIG}); pass --resume to continue it "
                         f"or choose another --output-dir")
    return resume_checkpoint(out, say)


def checkpoints(out: str) -> list[tuple[int, str]]:
    """[(step, name)] of the checkpoint-<step> directories in out, oldest first."""
    found = [(int(m.group(1)), d) for d in os.listdir(out) if (m := CHECKPOINT_RE.fullmatch(d))]
    return sorted(found)


def resume_checkpoint(out: str, say=print) -> str | None:
    """The newest checkpoint inside out whose manifest verifies; `latest` is only compared with it.
    None when there is no checkpoint at all; a SystemExit (naming each reason) when none verifies."""
    hint = None
    latest = os.path.join(out, LATEST)
    if os.path.exists(latest):
        with open(latest, "rb") as f:
            hint = f.read().decode("utf-8", "replace").strip()
        if not CHECKPOINT_RE.fullmatch(hint):
            say(f"warning: {latest} names {hint!r}, not a checkpoint of this run: ignored")
            hint = None
    found = checkpoints(out)
    problems = []
    for step, name in reversed(found):
        path = os.path.join(out, name)
        why = verify_checkpoint(path, root=out)
        if why is None:
            if hint is None:
                say(f"resuming from {name}, the newest complete checkpoint ({LATEST} is missing or unusable)")
            elif hint != name:
                say(f"resuming from {name}, the newest complete checkpoint ({LATEST} names {hint})")
            return path
        problems.append(f"{name}: {why}")
        say(f"warning: {name} is not a complete checkpoint ({why}): passed over")
    if problems:
        raise SystemExit(f"error: no checkpoint in {out} verifies, so --resume cannot continue the run "
                         f"(nothing was changed): " + "; ".join(problems))
    say(f"--resume: {out} has no checkpoint yet" + (f" ({LATEST} names {hint}, which does not exist)" if hint else "")
        + ": starting at step 0")
    return None


# ----------------------------------------------------------------------------------------------
# checkpoints


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str, **fields) -> None:
    """manifest.json, written last: the size and sha256 of every other file in directory (each flushed
    to disk first: power loss, not just a kill), and fields (a checkpoint's step, ...)."""
    files = {}
    for f in sorted(os.listdir(directory)):
        path = os.path.join(directory, f)
        if f == MANIFEST or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        files[f] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    write_atomic(os.path.join(directory, MANIFEST), json.dumps({**fields, "files": files}, indent=1))


def verify_manifest(path: str, required: tuple = ()) -> str | None:
    """None if the directory's manifest lists every `required` file and every file it lists has its
    size and sha256, else why not (one phrase)."""
    if not os.path.isdir(path):
        return "not a directory"
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}")
    except FileNotFoundError:
        return f"no {MANIFEST} (written incompletely, or by a version without manifests)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__}: {e})"
    for name in required:
        if name not in files:
            return f"{MANIFEST} lists no {name}"
    for name, want in files.items():
        fp = os.path.join(path, name)
        if not (isinstance(want, dict) and type(want.get("size")) is int and isinstance(want.get("sha256"), str)):
            return f"{MANIFEST} has a malformed entry for {name!r}"
        if os.path.basename(name) != name or not os.path.isfile(fp):
            return f"{name} is missing"
        if os.path.getsize(fp) != want["size"]:
            return f"{name} has {os.path.getsize(fp)} bytes, the manifest says {want['size']}"
        if _sha256(fp) != want["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST} (corrupted)"
    return None


def save_base(out: str, write, **fields) -> str:
    """<out>/base: write(directory) fills .tmp-base (checkpoint.save_pretrained), its manifest (with
    fields: what the codes were computed from) is written last and the directory renamed whole, as a
    checkpoint is. -> its path."""
    tmp, final = os.path.join(out, ".tmp-" + BASE), os.path.join(out, BASE)
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    write_manifest(tmp, **fields)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(out)
    return final


def base_problem(out: str, **fields) -> str | None:
    """Why <out>/base is not the saved base of these fields (its manifest lists config.json, matches
    every file and records the same fields), else None."""
    path = os.path.join(out, BASE)
    why = verify_manifest(path, ("config.json",))
    if why is None:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            recorded = json.load(f)
        differ = sorted(k for k in fields if recorded.get(k) != fields[k])
        why = f"it was quantized with other {', '.join(differ)}" if differ else None
    return why


def verify_checkpoint(path: str, root: str | None = None) -> str | None:
    """None if the checkpoint directory is complete (its manifest matches every file) and, inside the
    run `root`, the run's run_config.json is the one it was written with; else why not."""
    if root is not None and os.path.dirname(os.path.realpath(path)) != os.path.realpath(root):
        return f"it links outside the run ({os.path.realpath(path)})"
    why = verify_manifest(path, (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, TRAINER_STATE))
    if why is None and root is not None:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            recorded = json.load(f).get(RUN_CONFIG)
        config = os.path.join(root, RUN_CONFIG)
        if recorded is not None and (not os.path.isfile(config) or _sha256(config) != recorded):
            why = (f"the run's {RUN_CONFIG} is not the one this checkpoint was written with (its sha256 differs "
                   f"from the manifest's): it was edited or damaged since; restore it")
    return why


def config_problem(out: str) -> str | None:
    """Why <out>/run_config.json is not the one the run's checkpoints were written with (each manifest
    records its sha256), else None. It reads the manifests and that file only, so that --resume refuses an
    edited run_config.json before anything it names is used (verify_checkpoint checks each checkpoint whole)."""
    recorded = []
    for _, name in reversed(checkpoints(out)):
        try:
            with open(os.path.join(out, name, MANIFEST), encoding="utf-8") as f:
                sha = json.load(f).get(RUN_CONFIG)
        except (OSError, ValueError, AttributeError):   # a damaged checkpoint: resume_checkpoint names it
            continue
        if isinstance(sha, str):
            recorded.append((name, sha))
    if not recorded or _sha256(os.path.join(out, RUN_CONFIG)) in {sha for _, sha in recorded}:
        return None
    return (f"it is not the {RUN_CONFIG} {recorded[0][0]} was written with (its sha256 differs from the manifest's): "
            f"edited or damaged since; restore it (a flag that may change is given on the command line)")


# What eval.py and export.py read of the run an adapter was saved in, and the type each must have.
RUN_SETTINGS = {"model": str, "quant": str, "quantizer": str, "system_prompt": str,
                "chat_template_kwargs": (dict, type(None))}


def run_settings(adapter: str | None) -> dict | str:
    """What the train.py run an adapter directory was saved in (runs/x/checkpoint-N: its parent holds the
    run_config.json) recorded of its base and its prompt, the keys of RUN_SETTINGS it has; {} for an
    adapter outside a run; or, as a string, why that file cannot be read: what the adapter was trained
    with is then unknown."""
    path = os.path.join(os.path.dirname(os.path.abspath(adapter)), RUN_CONFIG) if adapter else None
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, ValueError) as e:   # ValueError: bad JSON or bad UTF-8
        return f"{path} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(run, dict) or not all(isinstance(run[k], t) for k, t in RUN_SETTINGS.items() if k in run):
        return f"{path} does not hold the run's model and prompt settings as train.py writes them"
    return {k: run[k] for k in RUN_SETTINGS if k in run}


def run_base(adapter: str | None, run: dict, quant: str | None, quantizer: str | None) -> tuple | str:
    """The base an adapter is evaluated or exported on (eval.py, export.py): --quant and --quantizer, each
    taken from its run (run: run_settings) where not given, else nvfp4 and rtn. -> (the directory to load
    the weights from, or None for --model's; quant; the quantizer to load with), or why it cannot be had.
    A gptq run's codes depend on its calibration prompts, so its base is the one it saved, <run>/base,
    checked by its manifest, and loaded as it is (already NVFP4: nothing is quantized)."""
    quant, quantizer = quant or run.get("quant", "nvfp4"), quantizer or run.get("quantizer", "rtn")
    if quant != "nvfp4":                         # a bf16 base has no codes to choose
        return None, quant, "rtn"
    if quantizer != "gptq":
        return None, quant, quantizer
    if run.get("quantizer") != "gptq":
        return ("--quantizer gptq needs calibration prompts: train.py --quantizer gptq quantizes with the run's "
                "own and saves that base in the run directory (base/), which eval.py and export.py load for the "
                "run's adapters")
    root = os.path.dirname(os.path.abspath(adapter))
    why, path = base_problem(root), os.path.join(root, BASE)
    return f"the run's saved base {path}: {why}" if why else (path, "nvfp4", "rtn")


def write_problem(directory: str) -> str | None:
    """Why files cannot be written in directory (made where missing), probed with a temporary file, else
    None: eval.py's --output and export.py's --out are checked before anything loads."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"cannot write in {directory} ({e.strerror or e})"
    return None


def verify_adapter(path: str) -> str | None:
    """Why the adapter directory `path` (eval.py's and export.py's --adapter) must not be loaded, else
    None: it lacks the PEFT files, its manifest does not verify, or it is a train.py checkpoint without
    one (a checkpoint's manifest is written last: it is incomplete, or was altered). A PEFT adapter from
    elsewhere has no manifest and passes: the loader's checks alone apply to it."""
    missing = [f for f in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return f"{path} has no {' or '.join(missing)}"
    if os.path.exists(os.path.join(path, MANIFEST)):
        why = verify_manifest(path, (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG))
    elif os.path.exists(os.path.join(path, TRAINER_STATE)) or (
            CHECKPOINT_RE.fullmatch(os.path.basename(os.path.abspath(path)))
            and os.path.exists(os.path.join(os.path.dirname(os.path.abspath(path)), RUN_CONFIG))):
        why = f"a train.py checkpoint without its {MANIFEST} (written incompletely, or altered)"
    else:
        return None
    return why and f"{path} is not intact: {why}"


def _nonfinite(named_tensors) -> str | None:
    """The name of the first tensor holding NaN or Inf, with what it holds."""
    for name, t in named_tensors:
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            kind = "NaN" if torch.isnan(t).any() else "Inf"
            return f"{name} holds {kind}"
    return None


def _optimizer_tensors(optimizer, names: dict):
    """(name, tensor) for every optimizer state tensor, named by its parameter (names: id -> name)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        for k, v in optimizer.state.get(p, {}).items():
            yield f"optimizer {k} of {names.get(id(p), 'a parameter')}", v


def save_checkpoint(out: str, step: int, model, optimizer, scheduler, data_pos: int, base_model: str, keep: int,
                    keep_rate: float = 1.0):
    """checkpoint-<step>/ = PEFT adapter + trainer_state.pt + manifest.json, written as .tmp-... and
    renamed; then `latest`, then the oldest beyond `keep` go. Checkpoints newer than this one stay.
    data_pos and keep_rate (grpo.fill_batch's) are what the next step's sampling starts from. -> its path."""
    names = {id(p): n for n, p in model.named_parameters()}
    bad = _nonfinite((n, p) for n, p in model.named_parameters() if p.requires_grad)
    bad = bad or _nonfinite(_optimizer_tensors(optimizer, names))
    if bad:
        raise SystemExit(f"error: at step {step} {bad}; the checkpoint is not written and the run stops "
                         f"(the previous checkpoint in {out} is intact)")
    name = f"checkpoint-{step:06d}"
    tmp, final = os.path.join(out, f".tmp-{name}"), os.path.join(out, name)
    shutil.rmtree(tmp, ignore_errors=True)
    lora.save_adapter(model, tmp, base_model)
    state = {"step": step, "data_pos": data_pos, "keep_rate": keep_rate, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}
    torch.save(state, os.path.join(tmp, TRAINER_STATE))
    config = os.path.join(out, RUN_CONFIG)   # what resuming from it will check run_config.json against
    write_manifest(tmp, step=step, **({RUN_CONFIG: _sha256(config)} if os.path.isfile(config) else {}))
    if os.path.exists(final):  # only one that failed verification (else the run would have resumed from it)
        aside = f"{final}.unverified-{int(time.time())}"
        os.replace(final, aside)
        print(f"warning: {name} failed verification when the run resumed; kept as {os.path.basename(aside)}")
    os.replace(tmp, final)
    _fsync_dir(out)
    write_atomic(os.path.join(out, LATEST), name)
    older = [d for s, d in checkpoints(out) if s < step]
    for d in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    return final


def last_checkpoint(out: str) -> str:
    """Where a run that stops now can be resumed from, in words."""
    found = checkpoints(out)
    return (f"{os.path.join(out, found[-1][1])} (step {found[-1][0]}) is the last checkpoint, intact" if found
            else "no checkpoint was written yet")


def load_checkpoint(ckpt: str, model, optimizer, scheduler, base_model: str) -> dict:
    """Restore the adapter, optimizer and schedule from a verified checkpoint; returns its state
    (step, data_pos, keep_rate: 1.0 from a checkpoint written before it was kept, as a fresh run
    starts). Refuses, naming the tensor, anything non-finite."""
    try:
        lora.load_adapter(model, ckpt, base_model)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: cannot resume from {ckpt}: {e}") from None
    # Optimizer state holds only tensors and numbers: weights_only refuses anything that would unpickle code.
    try:
        state = torch.load(os.path.join(ckpt, TRAINER_STATE), map_location="cpu", weights_only=True)
    except Exception as e:  # code in the pickle (refused), a damaged zip: torch raises several kinds
        raise SystemExit(f"error: cannot resume from {ckpt}: {TRAINER_STATE} is not a tensors-only torch file "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    want = {"step": int, "data_pos": int, "optimizer": dict, "scheduler": dict}
    wrong = [k for k, t in want.items() if not isinstance(state.get(k), t)] if isinstance(state, dict) else list(want)
    opt_state = state["optimizer"].get("state") if not wrong else None
    if wrong or not isinstance(opt_state, dict) or not all(isinstance(s, dict) for s in opt_state.values()):
        raise SystemExit(f"error: cannot resume from {ckpt}: {TRAINER_STATE} lacks or garbles {wrong or ['optimizer state']}")
    bad = _nonfinite((f"optimizer {k} of parameter #{i}", v) for i, s in opt_state.items() for k, v in s.items())
    if bad:
        raise SystemExit(f"error: cannot resume from {ckpt}: {TRAINER_STATE}: {bad}")
    m = CHECKPOINT_RE.fullmatch(os.path.basename(os.path.normpath(ckpt)))
    if m and int(m.group(1)) != state["step"]:
        raise SystemExit(f"error: cannot resume from {ckpt}: its {TRAINER_STATE} is of step {state['step']}")
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # another model's optimizer, a garbled one
        raise SystemExit(f"error: cannot resume from {ckpt}: its optimizer state does not fit this run "
                         f"({type(e).__name__}: {e})") from None
    state.setdefault("keep_rate", 1.0)
    return state


# ----------------------------------------------------------------------------------------------
# metrics and plots


def _spans(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _one_row_per_step(path: str, rows: list, step: int) -> list:
    """metrics.jsonl's rows up to `step` hold each step 1..step once: a repeated step keeps its first row,
    and a repeat or a gap (a row deleted, or cut) is said on screen rather than carried on."""
    seen, out, repeated = set(), [], []
    for row, line in rows:
        s = row.get("step") if isinstance(row, dict) else None
        if s in seen:
            repeated.append(s)
            continue
        seen.add(s)
        out.append((row, line))
    if repeated:
        print(f"warning: {path} has more than one row for step(s) {_spans(sorted(set(repeated)))}: the first is kept")
    missing = [s for s in range(1, step + 1) if s not in seen]
    if missing:
        print(f"warning: {path} has no row for step(s) {_spans(missing)} of the {step} before the resumed step "
              f"(deleted or cut?): the run goes on, and its record of those steps stays missing")
    return out


def truncate_rows(out: str, name: str, step: int) -> None:
    """Keep the lines of <out>/<name> (metrics.jsonl, completions.jsonl) of steps 1..`step` (the steps a
    run resumed after step `step` has done; a row's step counts from 1, as the progress line does), byte
    for byte: a resumed run rewrites what came after. The file is rewritten only if a line goes; a line
    that is not UTF-8 or not JSON (but the last, cut by a kill) stops the run with path:line rather than
    be dropped. metrics.jsonl holds one row per step: a gap or a repeat up to `step` is said (and a
    repeat dropped), and so is the file's absence once steps were taken."""
    path = os.path.join(out, name)
    if not os.path.exists(path):
        if name == METRICS and step > 0:
            print(f"warning: {path} is missing: the record of steps 1-{step} is lost; the run goes on")
        return
    rows = [(row, line) for row, line in read_jsonl_rows(path)
            if not (isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step)]
    if name == METRICS:
        rows = _one_row_per_step(path, rows, step)
    keep = "".join(line + "\n" for _, line in rows)
    with open(path, "rb") as f:
        if f.read() == keep.encode():
            return
    write_atomic(path, keep)


PLOTS = ("reward", "eval/accuracy", "loss", "grad_norm", "aqn/sigma", "step_time", "entropy", "completions/mean_length")


def plot_metrics(out: str) -> None:
    """plots.png: each of PLOTS against step (eval accuracy after the step it was measured at; step 0 is
    before training)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r, _ in read_jsonl_rows(os.path.join(out, METRICS)) if isinstance(r, dict) and "step" in r]
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.4))
    for ax, key in zip(axes.flat, PLOTS):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if key == "eval/accuracy":  # the first point is the model before training
            pts = [(0, r["eval/accuracy_initial"]) for r in rows if "eval/accuracy_initial" in r] + pts
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "plots.png"), dpi=100)
    plt.close(fig)
