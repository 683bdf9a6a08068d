"""train_bapo.py turns bad input into one clear `error:` line (exit code 2), before any model is loaded."""

import json
import subprocess
import sys

import pytest

from bapo_trl.cli.train import make_parser, run
from launching import REPO

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
def test_a_saved_run_carries_the_bapo_model_card(tmp_path, flags):
    """TRL's card with the BAPO section beside the saved weights; with LoRA it replaces PEFT's placeholder card."""
    out = _tiny_run(tmp_path, *flags)
    card = (out / "README.md").read_text()
    assert "## BAPO" in card and "2510.18927" in card and "More Information Needed" not in card
    assert (out / ("adapter_config.json" if flags else "config.json")).exists()


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
], ids=["use_cpu-false", "bf16-true", "equals-form", "fp16-false"])
def test_flags_the_user_wrote_win(argv, expected, note, tmp_path, capsys):
    _, args, _ = _parse(["--model_name_or_path", "some/model", *argv], tmp_path)
    assert {k: getattr(args, k) for k in expected} == expected
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(NOTE)]
    if note is None:
        assert lines == []
    else:
        assert len(lines) == 1 and note in lines[0], lines


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
    from bapo_trl.cli.summary import format_summary

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


def test_an_on_policy_recipe_says_so_once_and_fails_when_no_step_was_logged(tmp_path, capsys):
    """``bapo train --config recipe.yaml`` with on-policy data and TRL's logging_steps (10) above max_steps: one line
    at the start says BAPO acts as GRPO (BAPOConfig's warning is not repeated), and the run that logged no step exits
    with code 1 saying why (it printed "No training steps were logged." and exited 0; issue 52)."""
    import warnings

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nmax_steps: 2\nper_device_train_batch_size: 8\n"
                      "num_generations: 4\nmax_completion_length: 6\nreport_to: none\nsave_strategy: 'no'\n")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit_info:
        warnings.simplefilter("always")
        run(["--config", str(recipe)], parser=make_parser())
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    plans = [line for line in out.splitlines() if line.startswith("[bapo_trl] this run:")]
    assert len(plans) == 1 and "on-policy data" in plans[0] and "BAPO acts as GRPO" in plans[0]
    assert not [w for w in caught if "exactly on-policy" in str(w.message)]
    assert "No training steps were logged." in out
    assert ("error: no training step was logged (2 optimizer steps ran with logging_strategy=steps, "
            "logging_steps=10)") in err


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
