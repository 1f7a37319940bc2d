"""flags.py (and eval.py's parser): help and defaults for every flag, --config files merged under the
command line, --resume taking the run's recorded flags and refusing, by name, any that differ.

The run_config.json files here are written by the test (the values a run would record), so what
--resume must take back is known without train.py.
"""
import dataclasses
import json
import os
import time

import pytest

import aqn
import eval as qeval
import flags
import grpo
import lora
import reward_funcs
import run_dir
import tasks
from flags import parse_args


def walk(parser):
    """(action, its help as --help prints it, whitespace collapsed) for every flag but -h."""
    text = " ".join(parser.format_help().split())
    for action in parser._actions:   # argparse keeps its actions in a private list; nothing public walks them
        if action.dest != "help":
            yield action, text


@pytest.mark.parametrize("build", [flags.build_parser, qeval.build_parser], ids=["train.py", "eval.py"])
def test_every_flag_has_help_and_shows_its_default(build):
    parser = build()
    for action, text in walk(parser):
        name = action.option_strings[-1]
        assert action.help and len(action.help) > 8, f"{name} has no help text"
        if action.default is not None:
            shown = "(default: " + " ".join(str(action.default).split()) + ")"
            assert shown in text, f"{name}: --help does not show {shown}"
        else:  # None stands for a rule, which the help states
            assert "default" in action.help or "(required)" in action.help, \
                f"{name}: default None but the help does not say what happens"


def test_every_config_field_with_help_is_one_flag_of_one_section():
    """The command line is the config dataclasses' fields: each field with a help text is a flag, laid out
    once in --help's SECTIONS, and its default is the flag's."""
    placed = [name for names in flags.SECTIONS.values() for name in names]
    assert sorted(placed) == sorted(flags.FLAGS) and len(set(placed)) == len(placed), \
        sorted(set(placed) ^ set(flags.FLAGS))
    defaults = vars(flags.build_parser().parse_args([]))
    assert list(defaults) == placed, "the parser's flags in --help's order"
    for name, (f, _) in flags.FLAGS.items():
        want = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert defaults[name] == want and type(defaults[name]) is type(want), (name, defaults[name], want)


def test_to_config_builds_each_config_from_the_flags():
    args = parse_args(["--model", "m", "--lora-rank", "8", "--lora-alpha", "16", "--no-aqn", "--aqn-stages", "4",
                       "--group-size", "4", "--max-new-tokens", "64", "--overlong-cache", "8", "--loss-type", "bnpo",
                       "--importance-sampling", "token_mask", "--importance-sampling-min", "0.5"])
    assert flags.to_config(args, lora.LoRAConfig) == lora.LoRAConfig(r=8, alpha=16.0)
    assert flags.to_config(args, aqn.AQNConfig) == aqn.AQNConfig(enabled=False, stages=4)
    assert flags.to_config(args, grpo.GRPOConfig) == grpo.GRPOConfig(
        group_size=4, max_completion_len=64, overlong_cache_len=8, loss_type="bnpo", is_mode="token_mask", is_min=0.5)
    # with no flag given, each config is its own defaults
    plain = parse_args(["--model", "m"])
    for cls in (lora.LoRAConfig, aqn.AQNConfig, grpo.GRPOConfig):
        assert flags.to_config(plain, cls) == cls(), cls.__name__


def test_defaults_are_the_documented_ones():
    args = parse_args(["--model", "m"])
    assert (args.dataset, args.dataset_split, args.eval_split, args.reward, args.report_to) == \
        ("gsm8k", "train", "test", ["correctness"], "none")
    assert parse_args(["--model", "m", "--reward", "correctness", "--reward", "test_reward_funcs:picky"]).reward == \
        ["correctness", "test_reward_funcs:picky"], "a repeated --reward lists every term, the default replaced"


def write(path, text):
    path.write_text(text)
    return str(path)


def test_config_json_merges_under_the_command_line(tmp_path):
    cfg = write(tmp_path / "c.json", json.dumps({
        "model": "m", "lr": 3e-4, "max-new-tokens": 64, "aqn": False, "mask_truncated": True,
        "reward": ["correctness", "test_reward_funcs:picky"], "reward_weights": [1, 0.5],
        "chat-template-kwargs": {"enable_thinking": False}, "dataset": "addition"}))
    args = parse_args(["--config", cfg, "--lr", "1e-4"])
    assert args.lr == 1e-4, "the command line wins"
    assert (args.model, args.max_new_tokens, args.aqn, args.mask_truncated) == ("m", 64, False, True)
    assert args.reward == ["correctness", "test_reward_funcs:picky"] and args.reward_weights == [1.0, 0.5]
    assert args.chat_template_kwargs == {"enable_thinking": False} and args.dataset == "addition"
    assert parse_args(["--config", cfg, "--reward", "correctness", "--reward-weights", "2"]).reward == ["correctness"]


def test_config_yaml_merges_too(tmp_path):
    pytest.importorskip("yaml")
    cfg = write(tmp_path / "c.yaml", "model: m\ngroup_size: 4\ndynamic-sampling: true\nsystem_prompt: ''\n")
    args = parse_args(["--config", cfg, "--group-size", "6"])
    assert (args.model, args.group_size, args.dynamic_sampling, args.system_prompt) == ("m", 6, True, "")


@pytest.mark.parametrize("text, message", [
    ('{"model": "m", "learning_rte": 1e-5}', "unknown key 'learning_rte' (not a train.py flag, nor TRL's name for "
                                             "one); did you mean 'learning_rate'?"),
    ('{"model": "m", "lora_rnak": 8}', "unknown key 'lora_rnak' (not a train.py flag, nor TRL's name for one); did you "
                                       "mean 'lora_rank'?"),
    ('{"model": "m", "per_device_train_batch_size": 8}', "'per_device_train_batch_size' is TRL's name for a setting "
                                                         "that differs here: TRL's counts completions per device"),
    ('{"model": "m", "lr": null}', "'lr' is null, and --lr needs a value"),
    ('{"model": "m", "lr": 1e-5, "learning_rate": 1e-4}', "'lr' and 'learning_rate' both set --lr"),
    ('{"model": "m", "lr": "fast"}', "argument --lr: invalid float value: 'fast'"),
    ('{"model": "m", "quant": "int3"}', "argument --quant: invalid choice: 'int3'"),
    ('{"model": "m", "config": "other.json"}', "unknown key 'config'"),
    ('["model", "m"]', "want a mapping of flag names to values, got list"),
    ('{"model": ', "not valid JSON"),
])
def test_config_errors_name_the_file_and_key(tmp_path, capsys, text, message):
    cfg = write(tmp_path / "bad.json", text)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", cfg])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--config {cfg}: " in err and message in err, err


def recorded_run(tmp_path, **changes):
    """A run directory whose run_config.json records the flags of `--model m --dataset addition --lr 1e-05
    --lora-rank 4 --max-steps 7` (every other flag its default), as train.py writes it."""
    out = tmp_path / "run"
    out.mkdir(parents=True)
    rec = {**flags.record(flags.build_parser().parse_args([])), "model": "m", "dataset": "addition", "lr": 1e-5,
           "lora_rank": 4, "max_steps": 7, "aqn_steps": 7, "stop_at": 3, "output_dir": str(out), "world_size": 1,
           **changes}
    (out / "run_config.json").write_text(json.dumps(rec))
    return str(out)


def test_resume_takes_every_flag_from_the_run(tmp_path):
    out = recorded_run(tmp_path)
    args = parse_args(["--resume", out])
    assert (args.model, args.dataset, args.lr, args.lora_rank, args.max_steps) == ("m", "addition", 1e-5, 4, 7)
    assert args.resume is True and args.output_dir == out
    assert args.stop_at is None, "--stop-at belongs to one invocation, not to the run"
    same = parse_args(["--resume", "--output-dir", out, "--lr", "1e-5", "--device", "cpu", "--micro-batch", "2"])
    assert (same.lr, same.device, same.micro_batch) == (1e-5, "cpu", 2), "resumable flags may change"


def test_a_run_recorded_before_a_flag_existed_resumes_with_the_value_it_used(tmp_path):
    """dynamic_sampling_threshold came after runs that refilled every step (0); such a run resumes at 0,
    not at the new default 0.5, and a run that records the flag keeps its own value."""
    rec = vars(flags.build_parser().parse_args([]))
    old = {k: v for k, v in rec.items() if k != "dynamic_sampling_threshold"}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run_config.json").write_text(json.dumps({**old, "model": "m", "output_dir": str(tmp_path / "old")}))
    assert parse_args(["--resume", str(tmp_path / "old")]).dynamic_sampling_threshold == 0.0
    assert parse_args(["--resume", recorded_run(tmp_path)]).dynamic_sampling_threshold == 0.5


def test_the_quantizer_defaults_to_gptq_for_an_nvfp4_base_only(tmp_path, capsys):
    """--quantizer left out: gptq on an NVFP4 base, and nothing to choose on a bf16 one (recorded rtn, as
    before); a quantizer named with --quant bf16 is refused; a run recorded before the flag existed
    resumes with rtn, the codes it trained on."""
    assert parse_args(["--model", "m"]).quantizer == "gptq"
    assert parse_args(["--model", "m", "--quantizer", "rtn"]).quantizer == "rtn"
    assert parse_args(["--model", "m", "--quant", "bf16"]).quantizer == "rtn"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--quant", "bf16", "--quantizer", "gptq"])
    assert "--quantizer gptq chooses NVFP4 codes, and --quant bf16 has none" in capsys.readouterr().err
    rec = {k: v for k, v in vars(flags.build_parser().parse_args([])).items() if k != "quantizer"}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run_config.json").write_text(json.dumps({**rec, "model": "m", "output_dir": str(tmp_path / "old")}))
    assert parse_args(["--resume", str(tmp_path / "old")]).quantizer == "rtn"


def test_a_changed_flag_on_resume_is_refused_by_name_at_once(tmp_path, capsys):
    out = recorded_run(tmp_path)
    before = sorted(os.listdir(out))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        parse_args(["--resume", out, "--lr", "2e-5", "--lora-rank", "8", "--eval-every", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and time.monotonic() - t0 < 2
    assert "--lora-rank 8 differs from the run's 4; --lr 2e-05 differs from the run's 1e-05" in err, err
    assert "eval-every" not in err, "--eval-every may change on resume"
    cfg = write(tmp_path / "c.json", '{"dataset": "gsm8k"}')
    with pytest.raises(SystemExit):
        parse_args(["--resume", out, "--config", cfg])
    assert "--dataset gsm8k differs from the run's addition" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--resume", out, "--output-dir", str(tmp_path / "elsewhere")])
    assert "name different directories" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == before


@pytest.mark.parametrize("argv, message", [
    ([], "--model is required"),
    (["--model", "m", "--reward", "nope"], "--reward: 'nope': want 'correctness', 'module:function'"),
    (["--model", "m", "--reward-weights", "1,2"], "--reward-weights has 2 weight(s) for 1 reward(s)"),
    (["--model", "m", "--reward", "test_reward_funcs:picky", "--reward", "test_reward_funcs:picky"],
     "two terms are named 'picky'"),
    (["--model", "m", "--report-to", "trackio"], None),
    (["--model", "m", "--dataset", "addition", "--prompt-column", "q"], "--dataset: addition is built in"),
    (["--model", "m", "--log-completions", "-1"], "--log-completions must be >= 0"),
])
def test_refusals_at_parse_time(argv, message, capsys):
    import importlib.util
    if message is None:  # a tracker: refused only where its package is missing
        if importlib.util.find_spec("trackio") is not None:
            pytest.skip("trackio is installed")
        message = "--report-to trackio needs the trackio package: pip install trackio"
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1


def test_eval_takes_the_runs_prompt(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-000002").mkdir(parents=True)
    (run / "run_config.json").write_text(json.dumps({"system_prompt": "Answer in one line.",
                                                      "chat_template_kwargs": {"enable_thinking": False}}))
    assert run_dir.run_settings(str(run / "checkpoint-000002")) == {
        "system_prompt": "Answer in one line.", "chat_template_kwargs": {"enable_thinking": False}}
    assert run_dir.run_settings(str(tmp_path)) == {} and run_dir.run_settings(None) == {}
    assert tasks.SYSTEM_PROMPT and reward_funcs.BUILTIN == "correctness"


def test_eval_and_export_take_the_runs_base(tmp_path):
    """run_base: --quant and --quantizer from the run unless given; a gptq run's adapter goes on the base the
    run saved (its manifest checked, with what it was quantized from), never on a base quantized again."""
    adapter = str(tmp_path / "checkpoint-000002")
    assert run_dir.run_base(adapter, {"quant": "bf16"}, None, None) == (None, "bf16", "rtn")
    assert run_dir.run_base(adapter, {"quant": "bf16"}, "nvfp4", None) == (None, "nvfp4", "rtn")
    assert run_dir.run_base(adapter, {"quant": "nvfp4", "quantizer": "mse"}, None, None) == (None, "nvfp4", "mse")
    assert run_dir.run_base(None, {}, None, None) == (None, "nvfp4", "rtn")
    assert "needs calibration prompts" in run_dir.run_base(None, {}, None, "gptq")
    gptq = {"quant": "nvfp4", "quantizer": "gptq"}
    assert run_dir.run_base(adapter, gptq, None, None).endswith("base: not a directory")

    def write(d):
        os.makedirs(d)
        open(os.path.join(d, "config.json"), "w").write("{}")
    path = run_dir.save_base(str(tmp_path), write, model="m", calibration="abc")
    assert path == str(tmp_path / "base") and not os.path.exists(tmp_path / ".tmp-base")
    assert run_dir.run_base(adapter, gptq, None, None) == (path, "nvfp4", "rtn")
    assert run_dir.run_base(adapter, gptq, "bf16", None) == (None, "bf16", "rtn")   # the bf16 model, as asked
    assert run_dir.base_problem(str(tmp_path), model="m", calibration="abc") is None
    assert run_dir.base_problem(str(tmp_path), model="m", calibration="abd") == "it was quantized with other calibration"
    open(os.path.join(path, "config.json"), "w").write("{} ")
    assert "config.json has 3 bytes" in run_dir.run_base(adapter, gptq, None, None)


def test_trl_names_read_as_the_flags_they_mean(tmp_path, capsys):
    """A --config file (and config()) may use TRL's names for the same settings; the mapping is said in
    one line, and TRL's names for settings that differ here are refused with what to use instead."""
    cfg = write(tmp_path / "trl.json", json.dumps({
        "model_name_or_path": "m", "learning_rate": 3e-6, "num_generations": 4, "max_completion_length": 64,
        "num_iterations": 2, "mask_truncated_completions": True, "logging_steps": 5, "save_steps": 25,
        "save_total_limit": 3, "eval_steps": 10, "gradient_checkpointing": True, "lora_r": 8, "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "v_proj"], "beta": 0.04, "epsilon_high": 0.28, "loss_type": "bnpo",
        "scale_rewards": False, "report_to": [], "dataset_name": "addition", "dataset_train_split": "train",
        "dataset_test_split": "test", "max_steps": 9, "seed": 3, "warmup_steps": 2, "max_grad_norm": 0.5}))
    args = parse_args(["--config", cfg])
    assert (args.model, args.lr, args.group_size, args.max_new_tokens, args.updates_per_rollout) == ("m", 3e-6, 4, 64, 2)
    assert (args.mask_truncated, args.log_every, args.save_every, args.keep_checkpoints, args.eval_every) == (True, 5, 25, 3, 10)
    assert (args.grad_checkpointing, args.lora_rank, args.lora_target_modules, args.scale_rewards) == \
        (True, 8, ("q_proj", "v_proj"), "none")
    assert (args.dataset, args.dataset_split, args.eval_split, args.max_steps, args.seed) == ("addition", "train", "test", 9, 3)
    err = capsys.readouterr().err
    assert "TRL's names read as qerl's flags: model_name_or_path as --model, learning_rate as --lr" in err
    assert set(flags.TRL_NAMES) & set(flags.FLAGS) == set() and set(flags.TRL_DIFFERENT) & set(flags.FLAGS) == set()
    assert set(flags.TRL_NAMES.values()) <= set(flags.FLAGS)
    with pytest.raises(flags.ConfigError, match="'gradient_accumulation_steps' is TRL's name for a setting that differs"):
        flags.config(model="m", gradient_accumulation_steps=4)
    assert flags.config(model="m", learning_rate=2e-5, num_generations=4).group_size == 4


def test_config_from_python_is_checked_as_the_command_line(tmp_path):
    """flags.config: the same parse and checks (types, choices, ranges), raised as ConfigError, one line."""
    assert flags.config(model="m", lr=1e-4, dataset="addition").lr == 1e-4
    for settings, message in [(dict(model="m", lr="fast"), "config(): argument --lr: invalid float value: 'fast'"),
                              (dict(model="m", temperature=0), "--temperature must be > 0"),
                              (dict(model="m", quant="int3"), "invalid choice: 'int3'"),
                              (dict(model="m", dataset={"train": []}), "a DatasetDict: pass one split"),
                              (dict(model="m", dataset=[{"prompt": ""}]), "the prompt (column 'prompt') is empty"),
                              (dict(model="m", lora_target_modules="lm_head"), "want linears of the decoder")]:
        with pytest.raises(flags.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            flags.config(**settings)


@pytest.mark.parametrize("argv, want", [
    (["--report-to", "tensorboard,wandb"], "tensorboard,wandb"),
    (["--report-to", "wandb", "--report-to", "trackio"], "wandb,trackio"),
    (["--report-to", "none"], "none"),
])
def test_several_report_to_backends(argv, want, monkeypatch):
    import checks
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: object())   # as if all were installed
    assert parse_args(["--model", "m", *argv]).report_to == want


@pytest.mark.parametrize("argv, message", [
    (["--report-to", "none,wandb"], "want 'none', or one or more of"),
    (["--stop-at", "300"], "--stop-at 300 is past --max-steps 200"),
    (["--output-dir", ""], "--output-dir is empty"),
    (["--device", "cuda:99"], "--device cuda:99"),
    (["--lora-target-modules", "q_proj,embed_tokens"], "want linears of the decoder"),
])
def test_more_refusals_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_lora_target_modules_take_peft_names():
    assert parse_args(["--model", "m"]).lora_target_modules == lora.DEFAULT_TARGETS
    assert parse_args(["--model", "m", "--lora-target-modules", "all-linear"]).lora_target_modules == lora.DEFAULT_TARGETS
    args = parse_args(["--model", "m", "--lora-target-modules", "q_proj,v_proj"])
    assert flags.to_config(args, lora.LoRAConfig).target_modules == ("q_proj", "v_proj")


def test_a_resumed_runs_record_is_checked_by_name(tmp_path, capsys):
    """run_config.json's values are parsed as flags, strictly: a wrong type, a missing flag or an unknown
    key is refused naming the file and the key (the run here has no checkpoint, so no manifest to check)."""
    for changes, message in [({"lr": "1e-05"}, "'lr' holds '1e-05', a str, where train.py records 1e-05"),
                             ({"lora_rank": 4.5}, "argument --lora-rank: invalid int value: '4.5'"),
                             ({"max_steps": 0}, "'max_steps' must be >= 1, got 0"),
                             ({"lr_decay": 0.1}, "unknown key 'lr_decay'")]:
        out = recorded_run(tmp_path / str(len(os.listdir(tmp_path))), **changes)
        with pytest.raises(SystemExit):
            parse_args(["--resume", out])
        err = capsys.readouterr().err
        assert f"--resume: {out}/run_config.json: {message}" in err, err
    out = recorded_run(tmp_path / "missing")
    rec = json.load(open(os.path.join(out, "run_config.json")))
    del rec["lora_alpha"]
    open(os.path.join(out, "run_config.json"), "w").write(json.dumps(rec))
    with pytest.raises(SystemExit):
        parse_args(["--resume", out])
    assert "run_config.json lacks 'lora_alpha'" in capsys.readouterr().err
