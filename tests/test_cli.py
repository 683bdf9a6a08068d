"""train_bapo.py turns bad input into one clear `error:` line (exit code 2), before any model is loaded."""

import json
import os
import subprocess
import sys

import pytest

from bapo_trl.cli.train import make_parser, parse_args, run
from support.launching import REPO

pytestmark = pytest.mark.usefixtures("use_test_cache")  # train_bapo.py builds the embedded model there

CASES = [
    # (argv, fragments of the one error: for bad settings the field, the allowed range and the value given)
    (["--positive_contribution_target", "2"], ("`positive_contribution_target`", "(0, 1)", "got 2.0")),
    (["--ratio_upper_start", "0.5"], ("`ratio_upper_start`", "[1, 1e6)", "got 0.5")),
    (["--bapo_variant", "fast"], ("bapo_variant", "'paper', 'verl'", "'fast'")),
    (["--loss_type", "ppo"], ("`loss_type`", "('dapo', 'bnpo', 'grpo', 'dr_grpo', 'luspo', 'cispo', 'sapo', 'vespo')",
                              "'ppo'")),
    (["--replay_ratio", "0.5"], ("`replay_buffer_size`", ">= 1", "replay_ratio=0.5")),
    (["--replay_buffer_size", "8", "--replay_ratio", "1.5"], ("`replay_ratio`", "[0, 1)", "got 1.5")),
    (["--reward_funcs", "no_such_reward"], ("no_such_reward",)),
    (["--reward_funcs", "no_such_module.fn"], ("no_such_module",)),
    (["--dataset_name", "/nonexistent/prompts.jsonl"], ("does not exist",)),
    # named before the dataset (which does not exist) is read: it was checked after the load
    (["--dataset_name", "/nonexistent/prompts.jsonl", "--reward_funcs", "reverse", "--math_dataset_format", "gsmk8"],
     ("Unknown `math_dataset_format` 'gsmk8'", "'gsm8k'")),
    (["--model_name_or_path", "/nonexistent/model", "--reward_funcs", "reverse", "--use_cpu", "--bf16", "false"],
     ("cannot load model",)),
]


@pytest.mark.parametrize("argv,fragments", CASES, ids=[c[1][0].strip("`") for c in CASES])
def test_bad_input_is_one_clear_error(argv, fragments, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run(argv + ["--output_dir", str(tmp_path)], parser=make_parser())
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err and "usage:" not in err


def test_missing_prompt_column_lists_the_columns(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i:03d}>", "answer": "x"}) for i in range(4)))
    with pytest.raises(SystemExit):
        run(["--dataset_name", str(data), "--output_dir", str(tmp_path)], parser=make_parser())
    err = capsys.readouterr().err
    assert "'prompt'" in err and "question" in err and "--prompt_column" in err


@pytest.mark.slow  # a train_bapo.py process importing TRL and torch (10 s); the messages are checked in-process above
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_a_real_process_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train_bapo.py"), "--ratio_lower_step", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "`ratio_lower_step` must be > 0" in proc.stderr and "Traceback" not in proc.stderr


def test_a_finished_cpu_job_of_several_processes_exits_0_after_its_exit_handlers(tmp_path):
    """The end of a multi-process CPU job (gloo) skips the interpreter's finalization, where gloo's worker threads can
    abort the process (see exit_past_gloo_teardown): exit code 0, the exit handlers ran (the weight directories'
    cleanup is one), and buffered output is not lost. The launches in test_launch.py run it end to end."""
    script = tmp_path / "job.py"
    script.write_text(
        "import atexit, sys\n"
        "from bapo_trl.cli.train import exit_past_gloo_teardown\n"
        f"atexit.register(lambda: open({str(tmp_path / 'handler')!r}, 'w').write('ran'))\n"
        "print('buffered', end='')\n"
        "sys.stderr.write('err')\n"
        "exit_past_gloo_teardown()\n"
        "print('never')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "buffered", "err")
    assert (tmp_path / "handler").read_text() == "ran"


@pytest.mark.parametrize("processes,device,use_vllm,mode,expected", [
    (2, "cpu", False, "server", True),
    (2, "cpu", True, "server", True),  # the server is another process: nothing of it to finalize here
    (2, "cpu", True, "colocate", False),  # vLLM's CPU engine removes its /dev/shm segments only at finalization
    (1, "cpu", False, "server", False),
    (2, "cuda", False, "server", False),
])
def test_which_jobs_exit_past_the_gloo_teardown(processes, device, use_vllm, mode, expected):
    from types import SimpleNamespace

    from bapo_trl.cli.train import exits_past_gloo_teardown

    args = SimpleNamespace(use_vllm=use_vllm, vllm_mode=mode)
    assert exits_past_gloo_teardown(processes, device, args) is expected


def test_local_jsonl_dataset_with_another_prompt_column(tmp_path):
    from bapo_trl.cli.data import load_prompts
    from bapo_trl.cli.train import parse_args

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i:03d}>", "answer": f"{i:03d}"[::-1]}) for i in range(8)))
    script_args, training_args, _ = parse_args(
        ["--dataset_name", str(data), "--prompt_column", "question", "--output_dir", str(tmp_path)])
    train, _ = load_prompts(script_args, training_args)
    assert train.column_names == ["prompt", "answer"] and train[0]["prompt"] == "000>"


def _tiny_run(tmp_path, *flags):
    from bapo_trl.cli.train import run

    out = tmp_path / "run"
    run(["--max_steps", "2", "--per_device_train_batch_size", "16", "--steps_per_generation", "2",
         "--output_dir", str(out), *flags], parser=make_parser())
    return out


@pytest.mark.parametrize("flags", [(), ("--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj")],
                         ids=["full", "lora"])
def test_a_saved_run_carries_the_bapo_model_card(tmp_path, flags, capsys):
    """TRL's card with the BAPO section beside the saved weights; with LoRA it replaces PEFT's placeholder card. The
    base model, a local directory, is named by its path (TRL's card said "a fine-tuned version of [None]"). The run
    starts with its plan and ends by printing where it saved and what is there."""
    out = _tiny_run(tmp_path, *flags)
    card = (out / "README.md").read_text()
    assert "## BAPO" in card and "2510.18927" in card and "More Information Needed" not in card
    assert (out / ("adapter_config.json" if flags else "config.json")).exists()
    printed = capsys.readouterr().out
    plan = plan_block(printed)
    base = plan["model"].rsplit(": ", 1)[1]
    assert "[None]" not in card and f"fine-tuned version of the local model `{base}`." in card
    assert ("LoRA r=4" if flags else "every weight") in plan["model"]
    assert plan["writes to"].startswith(f"{out}: ") and ("LoRA adapter" in plan["writes to"]) == bool(flags)
    listing = saved_listing(printed)
    assert listing["folder"] == str(out) and set(listing["entries"]) == {
        p.name + ("/" if p.is_dir() else "") for p in out.iterdir()}
    weights = "adapter_model.safetensors" if flags else "model.safetensors"
    assert {"README.md", "dynamics.png", "bapo_log_history.json", "launch_info/", weights} <= set(listing["entries"])
    assert f"bapo plot {out}" in listing["entries"]["dynamics.png"]


def plan_block(out: str) -> dict[str, str]:
    """The rows of the block a `bapo train` run prints at its start (``{label: text}``); exactly one block."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "[bapo_trl] this run:"]
    assert len(starts) == 1, out[-3000:]
    rows = {}
    for line in lines[starts[0] + 1:]:
        if not line.startswith("  "):
            break
        label, text = line.strip().split(": ", 1)
        rows[label] = text.strip()
    return rows


def saved_listing(out: str) -> dict:
    """The listing a finished `bapo train` run prints last: the folder, and ``{entry: the rest of its line}``."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("[bapo_trl] saved in ")]
    assert len(starts) == 1, out[-3000:]
    entries = {}
    for line in lines[starts[0] + 1:]:
        if not line.startswith("  "):
            break
        name, rest = line.strip().split(None, 1)
        entries[name] = rest
    return {"folder": lines[starts[0]][len("[bapo_trl] saved in "):].rstrip(":"), "entries": entries}


def test_a_single_dataset_file_is_not_used_as_its_own_eval_split(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "123>"}\n{"prompt": "456>"}\n')
    with pytest.raises(SystemExit):
        run(["--dataset_name", str(data), "--eval_strategy", "steps", "--output_dir", str(tmp_path)],
            parser=make_parser())
    err = capsys.readouterr().err
    assert "is a single file, which holds only the training split" in err and "'test' split" in err


def test_quantization_flags_without_a_gpu_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(["--model_name_or_path", str(tmp_path), "--load_in_4bit", "--use_peft", "--reward_funcs", "reverse",
             "--use_cpu", "--bf16", "False",
             "--output_dir", str(tmp_path)], parser=make_parser())
    assert "`--load_in_4bit` quantizes the model with bitsandbytes, which needs a CUDA GPU" in capsys.readouterr().err


def test_a_grpo_config_gets_an_error_that_says_what_to_change(tiny_model_dir, tmp_path):
    from trl import GRPOConfig

    from bapo_trl import BAPOTrainer

    with pytest.raises(TypeError, match=r"replace `GRPOConfig\(\.\.\.\)` by `BAPOConfig\(\.\.\.\)`"):
        BAPOTrainer(model=tiny_model_dir, args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True))


# -- machines without CUDA: the CPU in float32 by default, explicit settings win --------------------------------------


def _parse(argv, tmp_path, cuda_available=False):
    from bapo_trl.cli.train import parse_args

    return parse_args(argv + ["--output_dir", str(tmp_path)], parser=make_parser(), cuda_available=cuda_available)


NOTE = "[bapo_trl] no CUDA device: training on the CPU in float32"


def test_without_cuda_a_model_of_your_own_trains_on_the_cpu_in_float32(tmp_path, capsys):
    _, args, _ = _parse(["--model_name_or_path", "some/model"], tmp_path)
    assert args.use_cpu and not args.bf16 and not args.fp16
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith(NOTE)] == [
        f"{NOTE} (use_cpu=True, bf16=False, fp16=False); pass --use_cpu / --bf16 / --fp16 to choose otherwise."]


@pytest.mark.parametrize("argv, expected, note", [
    # values equal to TRL's defaults still count: they were written
    (["--use_cpu", "false"], dict(use_cpu=False, bf16=False), "(bf16=False, fp16=False)"),
    (["--use_cpu", "--bf16", "true"], dict(use_cpu=True, bf16=True), None),
    (["--bf16=true", "--use_cpu=true"], dict(use_cpu=True, bf16=True), None),
    (["--fp16", "false", "--use_cpu", "true"], dict(use_cpu=True, bf16=False, fp16=False), "(bf16=False)"),
    # the precision the user chose is not called float32 (it was)
    (["--bf16", "true"], dict(use_cpu=True, bf16=True), "training on the CPU (use_cpu=True, fp16=False)"),
], ids=["use_cpu-false", "bf16-true", "equals-form", "fp16-false", "only-bf16-true"])
def test_flags_the_user_wrote_win(argv, expected, note, tmp_path, capsys):
    _, args, _ = _parse(["--model_name_or_path", "some/model", *argv], tmp_path)
    assert {k: getattr(args, k) for k in expected} == expected
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[bapo_trl] no CUDA device")]
    if note is None:
        assert lines == []
    else:
        assert len(lines) == 1 and note in lines[0], lines


@pytest.mark.parametrize("spelling", ["--model_name_or_path", "--model-name-or-path", "--model-name-or-path=x"])
def test_a_model_of_your_own_never_gets_the_toy_jobs_settings_whatever_the_flags_spelling(spelling, tmp_path):
    """TRL's parser takes a flag with dashes too: ``--model-name-or-path`` is a model of the user's own, so the
    embedded toy job's settings (learning rate 1e-3, 12 tokens, 160 steps, the CPU) are not applied; TRL's defaults
    are. Seen failing with only the underscore spelling recognised (the toy job's settings, silently)."""
    from trl import GRPOConfig

    argv = [spelling] if "=" in spelling else [spelling, "x"]
    _, args, model_args = _parse(argv, tmp_path)  # no CUDA here: the CPU defaults apply, and are said (tested above)
    trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert model_args.model_name_or_path == "x"
    for name in ("learning_rate", "lr_scheduler_type", "max_completion_length", "per_device_train_batch_size",
                 "steps_per_generation", "max_steps", "seed", "save_strategy", "logging_steps", "report_to"):
        assert getattr(args, name) == getattr(trl, name), name


def test_the_toy_job_takes_gradient_checkpointing_under_either_name(tmp_path):
    """The toy job turns activation checkpointing off by default; ``--gradient_checkpointing true`` (the name TRL's
    users know, which transformers maps onto ``activation_checkpointing``) turns it on, as the help says a flag
    does."""
    _, args, _ = _parse(["--gradient_checkpointing", "true"], tmp_path)
    assert args.activation_checkpointing and args.gradient_checkpointing
    _, args, _ = _parse([], tmp_path)
    assert not args.activation_checkpointing


@pytest.mark.parametrize("flags, expect", [
    (["--generation_batch_size", "64"], dict(generation_batch_size=64, steps_per_generation=2)),  # TRL refused both
    (["--num_train_epochs", "2"], dict(num_train_epochs=2.0, max_steps=-1)),  # max_steps=160 won
    (["--warmup_steps", "5"], dict(warmup_steps=5, lr_scheduler_type="constant_with_warmup")),  # constant: no warmup
    (["--save_steps", "10"], dict(save_steps=10, save_strategy="steps")),  # save_strategy=no: nothing saved
    (["--save_steps", "10", "--save_strategy", "no"], dict(save_strategy="no")),  # the user's own word wins
])
def test_a_flag_that_decides_an_embedded_default_otherwise_wins_over_it(flags, expect, tmp_path):
    """The embedded job's defaults give way to a flag of their own field, and also to one that decides that field
    another way: a default left in place refused the flag (generation_batch_size beside the default
    steps_per_generation) or silently outranked it (max_steps over num_train_epochs, save_strategy='no' over
    save_steps, a constant schedule over warmup_steps). Seen failing on the old code (the config review, C1)."""
    _, args, _ = _parse(flags, tmp_path)
    for name, value in expect.items():
        got = getattr(args, name)
        assert getattr(got, "value", got) == value, (name, got)


@pytest.mark.parametrize("flags, named", [
    (["--dtype", "bfloat16"], "`dtype`"), (["--model_revision", "v2"], "`model_revision`"),
    (["--attn_implementation", "sdpa"], "`attn_implementation`"),
    (["--prompt_column", "question"], "`prompt_column`"), (["--dataset_config", "main"], "`dataset_config`"),
    (["--math_dataset_format", "gsm8k"], "`math_dataset_format`"),
    (["--dataset_train_split", "other"], "`dataset_train_split`"),
])
def test_flags_for_a_model_or_dataset_of_ones_own_are_refused_by_the_embedded_job(flags, named, tmp_path):
    """The embedded job builds its tiny model and its reversal task: a flag on how a model is loaded, or how a
    dataset is read, would do nothing (they were dropped silently: the config review, C2 and C3). Refused by name
    before anything loads."""
    from bapo_trl.cli.train import SetupError, prepare

    script_args, args, model_args = _parse(flags, tmp_path)
    with pytest.raises(SetupError) as refused:
        prepare(script_args, args, model_args)
    assert named in refused.value.message and "drop them" in refused.value.message, refused.value.message


def test_dataset_streaming_is_refused_by_name_before_anything_loads(tmp_path):
    """TRL's ``--dataset_streaming`` (ScriptArguments) is shown by ``bapo train --help``, which loads a split whole:
    refused, naming the field and the Python API's way to stream, instead of loading it all silently."""
    from bapo_trl.cli.data import load_prompts

    script_args, args, _ = _parse(["--dataset_name", "nowhere/none", "--dataset_streaming", "true"], tmp_path)
    with pytest.raises(ValueError, match="`dataset_streaming` is not supported by bapo train.*IterableDataset"):
        load_prompts(script_args, args)


def test_a_config_file_key_wins_too(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: some/model\nuse_cpu: true\nbf16: true\n")
    _, args, _ = _parse(["--config", str(recipe)], tmp_path)
    assert args.use_cpu and args.bf16  # the recipe's choice, although this machine has no CUDA
    assert NOTE not in capsys.readouterr().out
    recipe.write_text("model_name_or_path: some/model\nlearning_rate: 1.0e-5\n")
    _, args, _ = _parse(["--config", str(recipe)], tmp_path)
    assert args.use_cpu and not args.bf16 and args.learning_rate == 1e-5
    assert NOTE in capsys.readouterr().out


@pytest.mark.parametrize("flags, plan", [
    (["--fp16", "true"], "fp16 on the CPU"), (["--dtype", "bfloat16"], "bfloat16 weights on the CPU"),
    ([], "float32 on the CPU"),
])
def test_the_cpu_note_and_the_plan_say_the_precision_the_run_has(flags, plan, tmp_path, capsys):
    """Without CUDA the note said "in float32" beside `--fp16 true` and `--dtype bfloat16` (the config review, C4/C5),
    and the plan said float32 for bfloat16 weights: float32 is said only where it is the default's choice."""
    from bapo_trl.cli.train import run_plan

    _, args, model_args = _parse(["--model_name_or_path", "some/model", *flags], tmp_path)
    out = capsys.readouterr().out
    assert ("in float32" in out) == (not flags), out
    assert "training on the CPU" in out
    assert plan in run_plan(args, model="m", weights_dtype=model_args.dtype)


def test_with_cuda_nothing_changes_and_the_embedded_job_needs_no_note(tmp_path, capsys):
    from bapo_trl.cli.train import apply_cpu_defaults

    assert apply_cpu_defaults(make_parser(), ["--model_name_or_path", "m"], cuda_available=True) == {}
    _, args, _ = _parse(["--model_name_or_path", "some/model", "--use_cpu"], tmp_path, cuda_available=True)
    assert args.bf16  # TRL's default where CUDA exists
    _, args, _ = _parse([], tmp_path)  # the embedded job: set up for the CPU already
    assert args.use_cpu and not args.bf16
    assert NOTE not in capsys.readouterr().out


def test_the_note_is_printed_by_rank_0_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    _, args, _ = _parse(["--model_name_or_path", "some/model"], tmp_path)
    assert args.use_cpu and NOTE not in capsys.readouterr().out


@pytest.mark.slow  # trains a model through train_bapo.py in a subprocess (10 s)
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_a_model_of_your_own_trains_without_cpu_flags_and_the_summary_says_search_never_active(tiny_model_dir,
                                                                                             tmp_path):
    """The command that used to end in "Your setup doesn't support bf16/gpu" without `--use_cpu true --bf16 false`;
    on-policy data (one optimizer step per generation), so the search never acts and the summary says so."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "train_bapo.py"), "--model_name_or_path", tiny_model_dir, "--reward_funcs",
         "reverse", "--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "6", "--steps_per_generation", "1", "--gradient_checkpointing", "false",
         "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "doesn't support bf16" not in proc.stderr
    assert len([line for line in proc.stdout.splitlines() if line.startswith(NOTE)]) == 1
    info = json.loads((tmp_path / "out" / "launch_info" / "rank0.json").read_text())
    assert info["device"] == "cpu"
    summary = proc.stdout.split("BAPO run summary", 1)[1]
    assert "search never active" in summary and "nan" not in summary and "mean bounds" not in summary


def test_the_summary_says_search_never_active_instead_of_nan_bounds():
    from bapo_trl.reporting.summary import format_summary

    inactive = {"bapo/search_active": 0.0, "bapo/clip_low": 0.6, "bapo/clip_high": 1.2, "bapo/search_steps": 0.0,
                "bapo/positive_contribution": 0.5, "bapo/positive_contribution_before": 0.5, "entropy": 1.0}
    history = [{"loss": 0.1, "step": 1, "reward": 0.25, **inactive},
               {"loss": 0.2, "step": 2, "reward": 0.5, **inactive}]
    summary = format_summary(history)
    assert "search never active (no window on the path changed the loss in any of the 2 updates" in summary
    assert "nan" not in summary and "mean bounds" not in summary
    assert "bounds moved in 0% of updates" in summary
    row = summary.splitlines()[2].split()
    assert row[:2] == ["1-1", "0.250"] and row[2:6] == ["-", "-", "-", "-"]  # no window where the search never acted
    active = dict(inactive, **{"bapo/search_active": 1.0, "bapo/clip_low": 0.7})
    summary = format_summary(history + [{"loss": 0.3, "step": 3, "reward": 0.5, **active}])
    assert "search active (some window on the path changes the loss) in 33% of updates" in summary
    assert "mean bounds [0.700, 1.200]" in summary


def test_the_summary_heading_says_which_generation_batches_its_rows_are():
    """Every batch when they fit; when thinned, how many of how many, which, and the rows are those (the heading said
    "one row per generation batch" over every other one)."""
    from bapo_trl.reporting.summary import format_summary

    def history(batches):
        return [{"loss": 0.1, "step": 2 * b + s + 1, "entropy": 1.0, **({"reward": b / 100} if s == 0 else {})}
                for b in range(batches) for s in range(2)]

    lines = format_summary(history(12)).splitlines()
    assert lines[0].startswith("BAPO run summary (one row per generation batch, all 12;")
    assert [line.split()[0] for line in lines[2:14]] == [f"{2 * b + 1}-{2 * b + 2}" for b in range(12)]
    lines = format_summary(history(20)).splitlines()
    assert lines[0].startswith("BAPO run summary (11 of the 20 generation batches: every 2nd and the last;")
    rows = [line.split()[0] for line in lines[2:] if line.split()[0][0].isdigit() and "-" in line.split()[0]]
    assert rows == [f"{2 * b + 1}-{2 * b + 2}" for b in (*range(0, 20, 2), 19)]
    assert format_summary(history(40)).splitlines()[0].startswith(
        "BAPO run summary (11 of the 40 generation batches: every 4th and the last;")  # 0, 4, ..., 36, then 39
    lines = format_summary(history(15)).splitlines()  # 0, 2, ..., 14: the last is one of them
    assert lines[0].startswith("BAPO run summary (8 of the 15 generation batches: every 2nd;")
    assert lines[10].startswith("reward (a generation batch's mean): start") and lines[9].split()[0] == "29-30"


def test_the_summary_gives_the_start_the_best_batch_and_the_end():
    """A run that peaked mid-way and fell back: the trend line says so (its first version said 0.569 -> 0.820 over
    a run that peaked at 0.957 and ended near 0.7)."""
    from bapo_trl.reporting.summary import format_summary

    rewards = [0.2, 0.4, 0.95, 0.9, 0.7, 0.6, 0.65, 0.6]
    history = [{"loss": 0.1, "step": 2 * b + s + 1, "entropy": 1.0, **({"reward": r} if s == 0 else {})}
               for b, r in enumerate(rewards) for s in range(2)]
    line = next(x for x in format_summary(history).splitlines() if x.startswith("reward"))
    assert line.startswith("reward (a generation batch's mean): start 0.300 (first quarter of the batches), best "
                           "0.950 (steps 5-6), end 0.625 (last quarter);"), line
    assert "(on the others the update was TRL's GRPO at the start window)" in line


def test_the_saved_listing_names_each_entry_and_says_what_it_is(tmp_path):
    from bapo_trl.reporting.summary import format_saved

    missing = tmp_path / "missing"
    assert format_saved(str(missing)) == f"[bapo_trl] nothing was saved: {missing} does not exist."
    assert "the folder is empty" in format_saved(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 2048)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "optimizer.pt").write_bytes(b"x" * 10)
    lines = format_saved(str(tmp_path)).splitlines()
    assert lines[0] == f"[bapo_trl] saved in {tmp_path}:"
    assert [line.split()[0] for line in lines[1:]] == ["model.safetensors", "notes.txt", "checkpoint-8/"]
    assert lines[1].split(None, 1)[1] == "2.0 KB  the trained weights"
    assert lines[2].split() == ["notes.txt", "4", "B"]  # not a file bapo train writes: its size only
    checkpoint = tmp_path / "checkpoint-8"
    assert lines[3].endswith(f"the checkpoint of step 8 (to train on from it: --resume_from_checkpoint {checkpoint} "
                             "with a higher --max_steps)")


def test_the_plan_names_the_data_format_the_checkpoints_and_the_stale_sources(tmp_path):
    from datasets import Dataset

    from bapo_trl.cli.train import run_plan

    script_args, args, _ = _parse(
        ["--model_name_or_path", "some/model", "--dataset_name", "prompts.jsonl", "--steps_per_generation", "4",
         "--replay_buffer_size", "8", "--replay_ratio", "0.5", "--save_steps", "50", "--logging_steps", "5",
         "--max_steps", "100", "--learning_rate", "2e-5"], tmp_path)
    chats = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}] * 3)
    plan = plan_block(run_plan(args, script_args, "some/model (every weight)", chats, ["boxed_accuracy"]))
    assert plan == {
        "model": "some/model (every weight)",
        "data": "prompts.jsonl, split 'train': 3 prompts, conversational (chat messages)",
        "rewards": "boxed_accuracy",
        "steps": "100 optimizer steps of 8 completions each (1 process), learning rate 2e-05 (linear), float32 on the "
                 "CPU; a generation batch of 4 prompts x 8 completions of up to 512 tokens every 4 optimizer steps",
        "staleness": "stale data (4 optimizer steps per generation batch, replay): BAPO re-chooses the clipping "
                     "window at every update.",
        "window": "the search path is the paper's path, BAPO around TRL's default window [0.8, 1.2]; "
                  "negative-advantage tokens' loss capped at delta=3 x |A| (the dual clip, on by default; TRL's "
                  "delta is unset: --no_dual_clip for TRL's one-sided clip)",
        "writes to": f"{tmp_path}: launch_info/ at the start, a checkpoint-N/ every 50 steps; at the end the model "
                     "with its card (README.md), dynamics.png and bapo_log_history.json; metrics every 5 steps to "
                     "metrics.jsonl (a progress bar on the console)",
    }
    texts = Dataset.from_list([{"prompt": "123>"}])
    assert plan_block(run_plan(args, script_args, "m", texts))["data"].endswith(": 1 prompt, plain text")
    # a batch that can start mid-accumulation (S=2, GA=3): its cadence, and the most updates it spans
    script_args, args, _ = _parse(["--model_name_or_path", "some/model", "--steps_per_generation", "2",
                                   "--gradient_accumulation_steps", "3"], tmp_path)
    plan = plan_block(run_plan(args, script_args, "m", texts))
    assert plan["steps"].endswith("every 2/3 optimizer steps (one can straddle 2 updates)"), plan["steps"]
    assert plan["staleness"].startswith("stale data (up to 2 optimizer steps per generation batch)"), plan["staleness"]
    for flags in (["--no_dual_clip"], ["--delta", "4.0"]):  # TRL's one-sided clip, or the user's own delta: no line
        script_args, args, _ = _parse(["--model_name_or_path", "some/model", *flags], tmp_path)
        assert "dual clip" not in plan_block(run_plan(args, script_args, "m", texts))["window"], flags


def test_bapo_train_exits_1_when_no_generation_batch_had_a_reward(tmp_path, monkeypatch, capsys):
    """A reward function that applies to nothing (None for every completion): TRL trains on with loss 0; the command
    reports the share in the summary and fails (issue 52)."""
    (tmp_path / "none_rewards.py").write_text("def never(completions, **kwargs):\n"
                                              "    return [None] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        run(["--reward_funcs", "none_rewards.never", "--max_steps", "2", "--per_device_train_batch_size", "8",
             "--num_generations", "4", "--steps_per_generation", "2", "--max_completion_length", "6",
             "--output_dir", str(tmp_path / "out")], parser=make_parser())
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert "generation batches with no reward (every reward function returned None): 1 of 1 (100%)" in out
    assert "error: no generation batch had a reward: in all 1, every reward function returned None" in err


def test_an_on_policy_recipe_says_so_once_and_a_run_too_short_to_log_is_warned_before_and_succeeds(tmp_path, capsys):
    """``bapo train --config recipe.yaml`` with on-policy data and TRL's logging_steps (10) above max_steps: one line
    at the start says BAPO acts as GRPO (BAPOConfig's warning is not repeated); a warning before any work says no step
    will be logged and how to log one; the run trains, saves and exits 0 (a trained, saved model is not a failure)."""
    import warnings

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nmax_steps: 2\nper_device_train_batch_size: 8\n"
                      "num_generations: 4\nmax_completion_length: 6\nreport_to: none\nsave_strategy: 'no'\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run(["--config", str(recipe)], parser=make_parser())  # no SystemExit: exit code 0
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "model.safetensors").exists()
    out, err = capsys.readouterr()
    plan = plan_block(out)
    assert plan["staleness"].startswith("on-policy data") and "BAPO acts as GRPO" in plan["staleness"]
    assert plan["data"] == "the embedded 3-digit reversal task: 4,096 prompts, plain text"
    assert plan["steps"].startswith("2 optimizer steps of 8 completions each (1 process), learning rate 1e-06")
    assert plan["writes to"].startswith(f"{tmp_path / 'out'}: launch_info/ at the start, no checkpoints")
    assert "metrics every 10 steps to metrics.jsonl" in plan["writes to"]
    assert not [w for w in caught if "exactly on-policy" in str(w.message)]
    assert "No training steps were logged." in out and "error:" not in err
    warned = [str(w.message) for w in caught if "`logging_steps` (10) exceeds `max_steps` (2)" in str(w.message)]
    assert len(warned) == 1 and "--logging_steps 1" in warned[0]


# --- DeepSpeed's shared-memory op on the CPU: a notice before its silent first build -------------------------------

@pytest.fixture
def deepspeed_ops(monkeypatch):
    """DeepSpeed's table of ops built at install (``deepspeed.git_version_info.installed_ops``), without importing
    DeepSpeed; a test sets entries in the returned dict."""
    import types

    installed = {}
    package, info = types.ModuleType("deepspeed"), types.ModuleType("deepspeed.git_version_info")
    info.installed_ops = installed
    monkeypatch.setitem(sys.modules, "deepspeed", package)
    monkeypatch.setitem(sys.modules, "deepspeed.git_version_info", info)
    return installed


def test_a_deepspeed_cpu_launch_says_it_compiles_the_shm_op_until_it_is_cached(deepspeed_ops, tmp_path):
    from bapo_trl.cli.train import SHM_OP, deepspeed_cpu_build_notice

    launch = {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2", "RANK": "0",
              "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    notice = deepspeed_cpu_build_notice([], launch, cuda_available=False)
    assert notice.startswith("[bapo_trl] DeepSpeed on the CPU: compiling its shared-memory op (deepspeed_shm_comm)")
    assert str(tmp_path / SHM_OP) in notice and "docs/distributed.md" in notice
    plain = {k: v for k, v in launch.items() if k != "ACCELERATE_USE_DEEPSPEED"}
    assert deepspeed_cpu_build_notice(["--deepspeed", "ds.json"], plain, cuda_available=False) == notice  # torchrun
    assert deepspeed_cpu_build_notice([], {**launch, "WORLD_SIZE": "1"}, cuda_available=False) == notice  # built too
    assert deepspeed_cpu_build_notice([], plain, cuda_available=False) is None  # not DeepSpeed
    assert deepspeed_cpu_build_notice([], {**launch, "RANK": "1"}, cuda_available=False) is None  # rank 0 says it
    assert deepspeed_cpu_build_notice([], launch, cuda_available=True) is None  # CUDA: NCCL, no shm op
    deepspeed_ops[SHM_OP] = True  # built into DeepSpeed's install (DS_BUILD_SHM_COMM=1)
    assert deepspeed_cpu_build_notice([], launch, cuda_available=False) is None
    deepspeed_ops[SHM_OP] = False
    (tmp_path / SHM_OP).mkdir()
    (tmp_path / SHM_OP / f"{SHM_OP}.so").write_bytes(b"")  # compiled by an earlier launch: loaded in under a second
    assert deepspeed_cpu_build_notice([], launch, cuda_available=False) is None


def test_the_notice_names_the_folder_torch_builds_in(deepspeed_ops, tmp_path, monkeypatch):
    """Without TORCH_EXTENSIONS_DIR: the folder torch.utils.cpp_extension would build the op in."""
    from torch.utils.cpp_extension import _get_build_directory

    from bapo_trl.cli.train import SHM_OP, deepspeed_cpu_build_notice

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    notice = deepspeed_cpu_build_notice([], {"ACCELERATE_USE_DEEPSPEED": "true"}, cuda_available=False)
    folder = _get_build_directory(SHM_OP, verbose=False)
    assert folder.startswith(str(tmp_path)) and f" into {folder} before" in notice


def test_parse_args_prints_the_notice_before_parsing(monkeypatch, capsys):
    """The build starts inside the parse (BAPOConfig's device setup starts DeepSpeed's backend): the line comes
    first."""
    import bapo_trl.cli.train as train

    seen = []
    monkeypatch.setattr(train, "deepspeed_cpu_build_notice", lambda argv, cuda_available=None: seen.append(argv) or
                        "NOTICE")
    train.parse_args(["--max_steps", "2"], parser=make_parser(), cuda_available=False)
    assert seen == [["--max_steps", "2"]] and capsys.readouterr().out.splitlines()[0] == "NOTICE"


def test_the_card_names_a_local_base_model_or_says_it_has_no_name():
    """TRL's card links a Hub id only: for a local directory it wrote "a fine-tuned version of [None]"."""
    from bapo_trl.trainer.model_card import NO_BASE_MODEL, name_base_model

    card = f"# Model Card for run\n\nThis model is a {NO_BASE_MODEL}.\nIt has been trained using TRL.\n"
    assert name_base_model(card, "/models/tiny") == (
        "# Model Card for run\n\nThis model is a fine-tuned version of the local model `/models/tiny`.\n"
        "It has been trained using TRL.\n")
    assert "no name or path recorded" in name_base_model(card, None) and "[None]" not in name_base_model(card, None)
    hub = "This model is a fine-tuned version of [org/model](https://huggingface.co/org/model).\n"
    assert name_base_model(hub, "org/model") == hub  # TRL named it: unchanged


@pytest.mark.parametrize("flags, says", [
    (["--max_step", "1"], "unknown option --max_step; did you mean --max_steps?"),  # a prefix is not taken
    (["--max_stpes", "1"], "unknown option --max_stpes; did you mean --max_steps?"),
    (["--max-stpes=1"], "unknown option --max-stpes; did you mean --max_steps?"),
    (["--frobnicate", "3"], "unknown option --frobnicate (`--help` lists the options)"),
], ids=["prefix", "typo", "dashes", "unrelated"])
def test_a_mistyped_or_shortened_flag_is_refused_with_a_suggestion_before_anything_is_written(flags, says, tmp_path,
                                                                                             capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*flags, "--output_dir", str(tmp_path / "out")], parser=make_parser())
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_folder_holding_another_runs_checkpoints_is_refused_unless_overwritten_or_resumed(tmp_path, capsys):
    """`bapo train --max_steps 1` into a folder with another run's checkpoint-N folders: refused, before any model is
    built, naming the three ways on; --overwrite_output_dir removes them and trains; a folder without checkpoints
    (a finished embedded run's, which saves none) trains again as before."""
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "marker").write_text("theirs")
    flags = ["--output_dir", str(out), "--max_steps", "1", "--num_train_prompts", "16"]
    with pytest.raises(SystemExit) as exit_info:
        run(flags, parser=make_parser())
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (f"--output_dir {out} holds another run's checkpoints (checkpoint-2): pass --resume_from_checkpoint "
            "latest to continue that run, --overwrite_output_dir to train a new one there") in err
    assert (out / "checkpoint-2" / "marker").exists()  # nothing touched
    run([*flags, "--overwrite_output_dir"], parser=make_parser())
    assert not (out / "checkpoint-2").exists()
    capsys.readouterr()
    run(flags, parser=make_parser())  # the embedded job replaces its own finished run (no checkpoint), and says so
    assert f"replaced the earlier run in {out}" in capsys.readouterr().out
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("train_runtime" in e for e in entries) == 1  # one run's lines, not both runs'


def test_a_finished_run_of_ones_own_is_refused_and_overwrite_with_resume_is_refused_before_anything_is_removed(
        tmp_path, capsys):
    """Issue 77 (3) and 75 (4): a user's run into a folder holding a finished run (model, metrics) is refused, naming
    --overwrite_output_dir; --overwrite_output_dir with a resume from that folder (``latest``, or a checkpoint path in
    it) is refused before anything is removed (it deleted every checkpoint, then failed: "no complete checkpoint")."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("metrics.jsonl", "model.safetensors", "config.json"):
        (out / name).write_text("theirs")
    own = ["--output_dir", str(out), "--model_name_or_path", str(tmp_path / "no-model"), "--reward_funcs", "reverse"]
    with pytest.raises(SystemExit) as exit_info:
        run(own, parser=make_parser())
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--output_dir {out} holds a finished run (" in err and "pass --overwrite_output_dir to replace it" in err
    assert all(name in err for name in ("metrics.jsonl", "model.safetensors", "config.json"))
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "marker").write_text("theirs")
    for resume in ("latest", str(out / "checkpoint-2")):
        with pytest.raises(SystemExit) as exit_info:
            run([*own, "--overwrite_output_dir", "--resume_from_checkpoint", resume], parser=make_parser())
        assert exit_info.value.code == 2
        assert "not both" in capsys.readouterr().err
        assert (out / "checkpoint-2" / "marker").exists() and (out / "model.safetensors").exists()


def test_a_resumed_run_logs_each_step_once_in_metrics_jsonl(tmp_path):
    """Issue 75 (7): metrics.jsonl was opened for appending, so a resume logged the steps between its checkpoint and
    the end (or crash) twice. A run of 4 steps checkpointed at 2, resumed from checkpoint-2: steps 1-4 once each."""
    out = tmp_path / "out"
    flags = ["--output_dir", str(out), "--max_steps", "4", "--num_train_prompts", "32", "--steps_per_generation", "1",
             "--save_strategy", "steps", "--save_steps", "2", "--disable_tqdm", "true"]
    run(flags, parser=make_parser())
    run([*flags, "--resume_from_checkpoint", str(out / "checkpoint-2")], parser=make_parser())
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "loss" in e] == [1, 2, 3, 4]


def test_a_resume_stopped_while_rewriting_metrics_jsonl_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """The resume keeps the entries up to its step: the kept lines replace the file whole (a stop mid-rewrite leaves
    the old one, every step of it), and the file is then appended to. Seen failing with the file truncated first."""
    from bapo_trl.cli.progress import open_metrics

    lines = "".join(json.dumps({"step": step, "loss": 0.1 * step}) + "\n" for step in (1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(lines)
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("stopped")))
        with pytest.raises(KeyboardInterrupt):
            open_metrics(str(tmp_path), 2)
    assert (tmp_path / "metrics.jsonl").read_text() == lines
    with open_metrics(str(tmp_path), 2) as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_run_shows_a_progress_bar_and_writes_every_metric_to_a_file_not_the_console(tmp_path, capsys):
    """No printed dict per logged step (transformers' ~70 metrics each): the bar's few numbers on stderr, every
    logged entry in output_dir/metrics.jsonl, which the saved listing names."""
    out = tmp_path / "out"
    trainer = run(["--output_dir", str(out), "--max_steps", "3", "--num_train_prompts", "32",
                   "--steps_per_generation", "1"], parser=make_parser())
    console = capsys.readouterr()
    assert "'loss'" not in console.out + console.err and "'bapo/clip_high'" not in console.out + console.err
    assert "training: 100%" in console.err and "reward=" in console.err
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "loss" in e] == [1, 2, 3]
    assert entries[:3] == [{"step": h["step"], **h} for h in trainer.state.log_history[:3]]
    assert "metrics.jsonl" in console.out and "every logged entry, one JSON line each" in console.out


def test_deepspeed_is_told_the_cpu_where_no_accelerator_is_found():
    """Its import then prints no "Setting accelerator to CPU" warning; a CUDA, XPU or MPS machine, or a user's own
    DS_ACCELERATOR, is left to DeepSpeed's detection."""
    from types import SimpleNamespace

    from bapo_trl.trainer.deepspeed_env import quiet_deepspeed_on_cpu

    def torch(cuda=False, xpu=False, mps=False):
        return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: cuda),
                               xpu=SimpleNamespace(is_available=lambda: xpu),
                               backends=SimpleNamespace(mps=SimpleNamespace(is_available=lambda: mps)))

    for device in ({}, {"cuda": True}, {"xpu": True}, {"mps": True}):
        environ = {}
        quiet_deepspeed_on_cpu(torch(**device), environ)
        assert environ == ({} if device else {"DS_ACCELERATOR": "cpu"}), device
    environ = {"DS_ACCELERATOR": "npu"}
    quiet_deepspeed_on_cpu(torch(), environ)
    assert environ == {"DS_ACCELERATOR": "npu"}


@pytest.mark.slow
@pytest.mark.side_by_side  # two fresh processes (~20 s), no server, no timing bound
def test_a_run_prints_no_warning_of_the_projects_own_making(tmp_path, tiny_model_dir, test_cache):
    """The embedded job in a fresh process: no DeepSpeed accelerator warning and no deprecation warning of a setting
    the project passes (transformers' `gradient_checkpointing` rename). A trainer built through the Python API, in a
    fresh process too, prints no DeepSpeed accelerator warning either."""
    proc = subprocess.run([sys.executable, str(REPO / "train_bapo.py"), "--max_steps", "1", "--output_dir",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Setting accelerator to CPU" not in proc.stderr + proc.stdout
    assert "`gradient_checkpointing` is deprecated" not in proc.stderr + proc.stdout
    assert "[bapo_trl] launch:" not in proc.stderr + proc.stdout  # the record is in launch_info/, not on the bar
    assert (tmp_path / "out" / "launch_info" / "rank0.json").exists()
    code = ("import sys\n"
            "from bapo_trl import BAPOConfig, BAPOTrainer\n"
            "from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward\n"
            f"args = BAPOConfig(output_dir={str(tmp_path / 'api')!r}, max_steps=1, per_device_train_batch_size=4,\n"
            "                  num_generations=4, max_completion_length=8, report_to=[], use_cpu=True, bf16=False)\n"
            f"BAPOTrainer(model={str(tiny_model_dir)!r}, args=args, reward_funcs=reverse_reward,\n"
            "            train_dataset=make_reverse_dataset(8))\n"
            "assert 'deepspeed' in sys.modules  # TRL's trainer imported it: the check below means something\n")
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "BAPO_TRL_CACHE": str(test_cache), "HF_HUB_OFFLINE": "1"})
    assert api.returncode == 0, api.stderr[-3000:]
    assert "Setting accelerator to CPU" not in api.stderr + api.stdout


def test_the_help_and_the_plan_read_as_written(capsys):
    """Issue 77 (9): ``--no_dual_clip`` says what it does (it repeated ``--dual_clip``'s help with "default: False"),
    ``bapo models --help`` shows no reStructuredText markup, and the plan says "1 optimizer step"."""
    import warnings

    from bapo_trl.cli.models import main as models_main
    from bapo_trl.cli.train import run_plan

    help_text = make_parser().format_help(full=True)
    entry = help_text.split("--no_dual_clip, --no-dual-clip")[1].split("\n  --")[0]
    assert "Turn --dual_clip off (dual_clip=False)." in entry and "default" not in entry
    with pytest.raises(SystemExit):
        models_main(["--help"])
    assert "``" not in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, args, _ = parse_args(["--max_steps", "1"])
    assert "1 optimizer step of" in run_plan(args)


def test_the_shipped_chat_arithmetic_task_is_one_flag_with_its_own_reward(tmp_path, tiny_model_dir):
    """Issue 77 (8): ``bapo train --model_name_or_path smollm2 --dataset_name chat_arithmetic`` is the README's SmolLM2
    example as one command: the shipped task's chat prompts and answers (train and test splits), scored by its own
    reward (``boxed_accuracy``) when no --reward_funcs is given; a reward of one's own still wins."""
    from bapo_trl.cli.train import prepare

    script_args, args, model_args = _parse(["--model_name_or_path", tiny_model_dir, "--dataset_name",
                                            "chat_arithmetic", "--eval_strategy", "steps"], tmp_path)
    rewards, train, evaluation = prepare(script_args, args, model_args)
    assert [getattr(f, "__name__", f) for f in rewards] == ["boxed_accuracy"]
    assert {"prompt", "answer"} <= set(train.column_names) and isinstance(train[0]["prompt"], list)
    assert 0 < len(evaluation) < len(train)
    script_args, args, model_args = _parse(["--model_name_or_path", tiny_model_dir, "--dataset_name",
                                            "chat_arithmetic", "--reward_funcs", "reverse"], tmp_path / "own")
    assert [getattr(f, "__name__", f) for f in prepare(script_args, args, model_args)[0]] == ["reverse_reward"]


#: A checkpoint's files in :func:`old_run`, its completion marker among them.
CHECKPOINT_FILES = {"model.safetensors", "trainer_state.json", "rng_state.pth", "bapo_checkpoint_complete.json"}


def test_the_model_check_before_training_trusts_remote_code_when_told(tmp_path, tiny_model_dir, monkeypatch):
    """``bapo train`` checks the model loads before anything else runs; with ``--trust_remote_code true`` (TRL's
    field) that check trusts it too, as TRL's script's loading does (a custom-code model was refused as "not a local
    model directory")."""
    import transformers

    from bapo_trl.cli.train import prepare

    seen, load = [], transformers.AutoConfig.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", recording)
    for flag in ("true", "false"):
        script_args, args, model_args = _parse(["--model_name_or_path", tiny_model_dir, "--reward_funcs", "reverse",
                                                "--trust_remote_code", flag],
                                               tmp_path / flag)
        prepare(script_args, args, model_args)
    assert seen[-2:] == [True, False], seen


@pytest.mark.parametrize("flags, named", [(["--dataset_config", "main"], "`dataset_config`"),
                                          (["--prompt_column", "question"], "`prompt_column`"),
                                          (["--math_dataset_format", "gsm8k"], "`math_dataset_format`")])
def test_flags_for_another_dataset_are_refused_with_the_shipped_task(flags, named, tmp_path):
    """The shipped task brings its own chat prompts and answers: a config, a prompt column or a math format for it
    would do nothing (they were ignored silently). Refused by name before anything loads."""
    from bapo_trl.cli.data import load_prompts

    script_args, args, _ = _parse(["--dataset_name", "chat_arithmetic", *flags], tmp_path)
    with pytest.raises(ValueError, match=rf"{named} cannot be used with the shipped task 'chat_arithmetic'"):
        load_prompts(script_args, args)


def old_run(folder) -> set[str]:
    """A finished run's folder as ``bapo train`` leaves it (two complete checkpoints, the model, its card, the
    metrics)."""
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        (folder / checkpoint).mkdir(parents=True)
        for name in CHECKPOINT_FILES:
            (folder / checkpoint / name).write_text("old")
    names = ("metrics.jsonl", "model.safetensors", "config.json", "README.md", "dynamics.png", "training_args.bin",
             "bapo_log_history.json", "tokenizer.json", "trainer_state.json")
    for name in names:
        (folder / name).write_text("old")
    return {"checkpoint-2", "checkpoint-4", *names}


def test_a_removal_of_the_previous_run_stopped_at_any_step_leaves_a_folder_still_seen_as_that_run(
        tmp_path, monkeypatch):
    """Issue 75 (faults at ``bapo train``'s start): ``--overwrite_output_dir`` removes the old run's files one by one;
    an error (or Ctrl-C) at any of them leaves a folder whose every remaining old file is still found as the old
    run's, so a plain ``bapo train`` there is still refused and the next overwrite removes the rest: nothing of the
    old run can survive beside a new one. And a checkpoint stopped half-removed is never taken as complete (``latest``
    would resume it without the files it lost). Seen failing with the run markers removed first (a stop after them
    left ``README.md`` and ``dynamics.png`` unseen), and with a checkpoint's marker removed with its other files."""
    import shutil

    from bapo_trl.cli import train
    from bapo_trl.trainer.checkpoints import checkpoint_folders, is_complete

    calls = {"n": 0, "stop": None}
    real = {name: getattr(os, name) for name in ("remove", "unlink", "rmdir")} | {"rmtree": shutil.rmtree}

    def counting(name):
        def remove(path, *args, **kwargs):
            if calls["n"] == calls["stop"]:
                raise KeyboardInterrupt(f"stopped at removal {calls['stop']}")
            calls["n"] += 1
            return real[name](path, *args, **kwargs)
        return remove

    stop = 0
    while True:
        out = tmp_path / f"out{stop}"
        expected = old_run(out)
        assert set(train.previous_run(str(out))) == expected
        calls.update(n=0, stop=stop)
        with monkeypatch.context() as patch:
            for name in ("remove", "unlink", "rmdir"):
                patch.setattr(os, name, counting(name))
            patch.setattr(shutil, "rmtree", counting("rmtree"))
            try:
                train.remove_previous_run(str(out))
            except KeyboardInterrupt:
                pass
            else:
                break  # every removal was reached: the stops before covered them all
        left = set(os.listdir(out))
        assert left and set(train.previous_run(str(out))) == left, (stop, left)
        for name in checkpoint_folders(str(out)):
            folder = out / name
            assert not is_complete(str(folder)) or set(os.listdir(folder)) == CHECKPOINT_FILES, (stop, name)
        train.remove_previous_run(str(out))
        assert not os.listdir(out)
        stop += 1
    assert stop > 11 and not os.listdir(out)  # the checkpoints' files are removed one by one


def test_an_overwrite_whose_trainer_refuses_its_settings_leaves_the_earlier_run_whole(tmp_path, monkeypatch):
    """``--overwrite_output_dir`` removes the earlier run only once the trainer has accepted the new run's settings:
    a refusal at construction (here a stand-in for any, e.g. replay with an image column) leaves every old file.
    Seen failing with the removal before the trainer was built."""
    from bapo_trl.trainer.bapo_trainer import BAPOTrainer

    out = tmp_path / "out"
    expected = old_run(out)

    def refuse(self, *args, **kwargs):
        raise ValueError("a setting this trainer refuses")

    monkeypatch.setattr(BAPOTrainer, "__init__", refuse)
    with pytest.raises((ValueError, SystemExit)):
        run(["--output_dir", str(out), "--max_steps", "1", "--overwrite_output_dir"], parser=make_parser())
    assert set(os.listdir(out)) == expected
    assert all((out / name / "model.safetensors").read_text() == "old" for name in ("checkpoint-2", "checkpoint-4"))


def test_a_new_run_after_an_interrupted_overwrite_is_one_whole_run(tmp_path, monkeypatch, capsys):
    """End to end: ``bapo train --overwrite_output_dir`` stopped while removing the old run, then run again, leaves one
    run's files: every file is the new run's and metrics.jsonl holds its steps once."""
    out = tmp_path / "out"
    old_run(out)
    flags = ["--output_dir", str(out), "--max_steps", "2", "--num_train_prompts", "16", "--steps_per_generation", "1",
             "--disable_tqdm", "true", "--overwrite_output_dir"]
    real_remove = os.remove

    def stop_at_the_third_file(path, *args, **kwargs):
        if stop_at_the_third_file.calls == 2:
            raise KeyboardInterrupt("Ctrl-C while removing the old run")
        stop_at_the_third_file.calls += 1
        return real_remove(path, *args, **kwargs)

    stop_at_the_third_file.calls = 0
    monkeypatch.setattr(os, "remove", stop_at_the_third_file)
    with pytest.raises(KeyboardInterrupt):
        run(flags, parser=make_parser())
    monkeypatch.undo()
    run(flags, parser=make_parser())
    assert all((out / name).read_bytes() != b"old" for name in os.listdir(out) if (out / name).is_file())
    assert not any(name.startswith("checkpoint-") for name in os.listdir(out))
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "loss" in e] == [1, 2]
