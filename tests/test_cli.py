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


def test_a_real_process_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train_bapo.py"), "--ratio_lower_step", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "`ratio_lower_step` must be > 0" in proc.stderr and "Traceback" not in proc.stderr


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
