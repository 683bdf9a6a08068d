r"""The math recipe offline: rewards on tricky answers, dataset formats, the shipped problems, avg@k evaluation on
the tiny model, every recipe parsed, and the CPU recipe trained (slow tier)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from datasets import Dataset

from bapo_trl.cli import evaluate as evaluate_command
from bapo_trl.cli.rewards import resolve_reward_funcs
from bapo_trl.cli.train import parse_args, prepare
from bapo_trl.recipes.math_reasoning import evaluate as math_eval
from bapo_trl.recipes.math_reasoning.data import SYSTEM_PROMPT, resolve_format, to_math_prompts
from bapo_trl.recipes.math_reasoning.rewards import SOFT_OVERLONG, boxed_accuracy, boxed_format_reward
from support.launching import REPO

pytestmark = pytest.mark.usefixtures("use_test_cache")  # train_bapo.py builds the embedded model there

PROBLEMS = REPO / "tests" / "data" / "math_problems.jsonl"
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def said(text):
    return [{"role": "assistant", "content": text}]


# (completion, reference answer, expected reward)
ANSWER_PAIRS = [
    (r"so the answer is \boxed{18}", "18", 1.0),
    (r"\boxed{18}", r"\boxed{18}", 1.0),  # reference boxed too
    (r"\boxed{18}", "$18$", 1.0),  # reference in $...$
    (r"\boxed{34}", r"\$34", 1.0),  # an escaped dollar sign is not math mode
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{1/2}", r"\dfrac{1}{2}", 1.0),
    (r"\boxed{\frac12}", "1/2", 1.0),  # shorthand math-verify alone does not read
    (r"\boxed{\sqrt{18}}", r"3\sqrt{2}", 1.0),  # bare LaTeX reference (math-verify alone reads it as 3)
    (r"\boxed{1024}", "2^{10}", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{17}", "18", 0.0),  # wrong
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{0.333}", "1/3", 0.0),  # a rounded decimal is not the fraction
    ("The answer is 18.", "18", 0.0),  # missing box
    (r"\boxed{18", "18", 0.0),  # unclosed box (truncated)
    (r"<think>maybe \boxed{3}</think> so \boxed{5}", "5", 1.0),  # last box after the reasoning
    (r"checking \boxed{5} ... </think> final: \boxed{3}", "5", 0.0),  # R1 style, <think> in the prompt
    (r"<think>so it is \boxed{5}", "5", 0.0),  # reasoning never finished: no answer yet
    (r"\boxed{5}", "", None),  # unparseable reference: skipped, not punished
]


def test_boxed_accuracy_on_tricky_pairs():
    rewards = boxed_accuracy([said(c) for c, _, _ in ANSWER_PAIRS], [a for _, a, _ in ANSWER_PAIRS])
    wrong = [(c, a, e, r) for (c, a, e), r in zip(ANSWER_PAIRS, rewards) if r != e]
    assert not wrong, wrong
    assert boxed_accuracy([r"\boxed{4}"], ["4"]) == [1.0]  # plain-text completions too


def test_boxed_format_reward():
    cases = {
        r"<think>work</think> \boxed{1}": 1.0,
        r"work</think> \boxed{1}": 1.0,  # <think> opened by the chat template (DeepSeek-R1 distills)
        r"no tags \boxed{1}": 1.0,
        r"<think>work \boxed{1}": 0.0,  # unfinished
        r"<think>work</think> 1": 0.0,  # no box
        r"</think><think> \boxed{1}": 0.0,
        r"<think>a</think><think>b</think> \boxed{1}": 0.0,
    }
    assert boxed_format_reward([said(c) for c in cases]) == list(cases.values())


def test_soft_overlong_penalties_are_registered_with_their_budgets():
    for name, (max_len, cache) in SOFT_OVERLONG.items():
        penalty = resolve_reward_funcs([name])[0]
        start = max_len - cache
        assert penalty(completion_ids=[[0] * start, [0] * (start + cache // 2), [0] * max_len]) == [0.0, -0.5, -1.0]


def test_every_shipped_problem_has_a_verifiable_answer():
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines()]
    assert len(rows) >= 20 and len({r["id"] for r in rows}) == len(rows)
    # the same value in another form, and a wrong value, for every problem (the files' answers mix forms)
    other_form = ["25", "36", "0.75", "5", "54", r"\frac{1}{6}", "1000", "720", r"\sqrt{50}", "34", "0.5", "9",
                  "13", "1.5", "4", "60", "3", "36", "17", r"14\pi", r"\frac{3}{5}", "-13", "-10"]
    wrong = ["24", "35", "0.7", "6", "45", "1/5", "1024", "540", "7", "35", "1", "8", "12", "2", "2", "65", "4",
             "72", "9", r"7\pi", "0.65", "13", "10"]
    answers = [r["answer"] for r in rows]
    assert boxed_accuracy([said(rf"\boxed{{{a}}}") for a in other_form], answers) == [1.0] * len(rows)
    assert boxed_accuracy([said(rf"\boxed{{{a}}}") for a in wrong], answers) == [0.0] * len(rows)


# --- dataset formats: one synthetic row per layout (written here, not downloaded)
LAYOUTS = [
    ("gsm8k", "openai/gsm8k", {"question": ["Tom has 3 apples and buys 4. How many?"],
                               "answer": ["3 + 4 = 7\n#### 7"]}, "7"),
    ("math", "DigitalLearningGmbH/MATH-lighteval",
     {"problem": ["Half of 3?"], "solution": [r"It is $\boxed{\frac{3}{2}}$."], "level": ["Level 1"],
      "type": ["Algebra"]}, r"\frac{3}{2}"),
    ("verl", "BytedTsinghua-SIA/DAPO-Math-17k",
     {"prompt": [[{"role": "user", "content": "Solve the following math problem step by step. The last line of "
                   "your response should be of the form Answer: $Answer (without quotes) where $Answer is the "
                   "answer to the problem.\n\nWhat is 6 times 7?\n\n"
                   "Remember to put your answer on its own line after \"Answer:\"."}]],
      "reward_model": [{"ground_truth": "42", "style": "rule"}], "data_source": ["math_dapo"]}, "42"),
    ("verl", "Skywork/Skywork-OR1-RL-Data",
     {"prompt": [[{"role": "user", "content": "What is 6 times 7? Please put your final answer within \\boxed{}."}]],
      "reward_model": [{"ground_truth": json.dumps(["42"]), "style": "rule"}]}, "42"),
    ("problem_answer", "HuggingFaceH4/aime_2024", {"problem": ["What is 6 times 7?"], "answer": ["42"]}, "42"),
]


@pytest.mark.parametrize("fmt,hub_id,columns,answer", LAYOUTS, ids=[f"{f}:{h}" for f, h, _, _ in LAYOUTS])
def test_layouts_map_to_prompt_and_answer(fmt, hub_id, columns, answer):
    dataset = Dataset.from_dict(columns)
    assert resolve_format("auto", hub_id, dataset.column_names) == fmt  # auto-detected by the dataset id
    mapped = to_math_prompts(dataset, "auto", dataset_name=hub_id)
    assert sorted(mapped.column_names) == ["answer", "prompt"]
    row = mapped[0]
    assert row["answer"] == answer
    system, user = row["prompt"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    # the dataset's own answer instructions are removed, the problem is kept
    assert "Answer:" not in user["content"] and "boxed" not in user["content"]
    assert ("6 times 7" in user["content"]) or ("apples" in user["content"]) or ("Half" in user["content"])


def test_format_errors_name_the_fix():
    with pytest.raises(ValueError, match="Unknown `math_dataset_format` 'gsm9k'"):
        resolve_format("gsm9k")
    with pytest.raises(ValueError, match="--math_dataset_format"):
        resolve_format("auto", "someone/else", ["text", "label"])
    with pytest.raises(ValueError, match="no column"):
        to_math_prompts(Dataset.from_dict({"problem": ["x"]}), "gsm8k", "openai/gsm8k")
    assert resolve_format("skywork") == resolve_format("dapo") == "verl"


@pytest.mark.parametrize("role", ["system", "user"])
def test_train_bapo_loads_the_shipped_problems(role, tmp_path):
    script_args, training_args, model_args = parse_args([
        "--dataset_name", str(PROBLEMS), "--math_dataset_format", "auto", "--math_instruction_role", role,
        "--reward_funcs", "boxed_accuracy", "boxed_format_reward", "--output_dir", str(tmp_path)])
    reward_funcs, train, _ = prepare(script_args, training_args, model_args)
    assert [f.__name__ for f in reward_funcs] == ["boxed_accuracy", "boxed_format_reward"]
    assert len(train) == len(PROBLEMS.read_text().splitlines()) and set(train.column_names) == {"prompt", "answer"}
    messages = train[0]["prompt"]
    if role == "system":
        assert [m["role"] for m in messages] == ["system", "user"]
    else:
        assert [m["role"] for m in messages] == ["user"] and messages[0]["content"].endswith(SYSTEM_PROMPT)


def test_pass_at_k_is_the_unbiased_estimator():
    assert math_eval.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert math_eval.pass_at_k(4, 0, 4) == 0.0 and math_eval.pass_at_k(4, 3, 2) == 1.0
    assert math_eval.pass_ks(16) == [1, 2, 4, 8, 16] and math_eval.pass_ks(6) == [1, 2, 4, 6]
    assert math_eval.summarize([2, 0], 2) == {"avg@2": 50.0, "pass@1": 50.0, "pass@2": 50.0}


def every_other_sample(completions, **kwargs):
    """A stand-in reward: the 1st of each pair of samples is right, so avg@2 = pass@1 = 50 and pass@2 = 100."""
    return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]


def run_eval(model_dir, output, *extra):
    return evaluate_command.main(["--model", model_dir, "--dataset", str(PROBLEMS), "--k", "2", "--num_problems", "3",
                           "--max_new_tokens", "8", "--output", str(output), *extra])


def test_evaluation_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path):
    report = run_eval(tiny_model_dir, tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["num_problems"] == report["num_scored"] == 3 and report["k"] == 2
    assert {"avg@2", "pass@1", "pass@2"} <= set(report) and 0.0 <= report["avg@2"] <= report["pass@2"] <= 100.0
    for problem in report["problems"]:
        assert len(problem["rewards"]) == 2 and all(r in (0.0, 1.0) for r in problem["rewards"])
        assert all(1 <= n <= 8 for n in problem["lengths"])
    # the arithmetic, with a reward whose answer is known
    known = run_eval(tiny_model_dir, tmp_path / "known.json", "--reward", "test_math_recipe.every_other_sample")
    assert (known["avg@2"], known["pass@1"], known["pass@2"]) == (50.0, 50.0, 100.0)


def test_evaluation_of_a_lora_adapter(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).save_pretrained(tmp_path / "adapter")
    report = run_eval(str(tmp_path / "adapter"), tmp_path / "adapter.json")  # tokenizer from the base model
    assert report["num_scored"] == 3


def test_evaluation_accepts_every_reward_name_training_does():
    """``evaluate --reward`` resolves through the recipe's own registry (no import of the command line): the same
    names as ``--reward_funcs``, to the same functions, and the same error for an unknown one."""
    from bapo_trl.cli.rewards import REWARD_FUNCS
    from bapo_trl.recipes import reward_funcs

    assert list(math_eval.REWARD_FUNCS) == list(REWARD_FUNCS)
    assert {"reverse", "accuracy_reward", "boxed_accuracy", "soft_overlong_8k"} <= set(REWARD_FUNCS)
    names = ["reverse", "think_format_reward", "boxed_format_reward", "bapo_trl.recipes.toy.reverse_reward"]
    assert reward_funcs.resolve(names, math_eval.REWARD_FUNCS) == resolve_reward_funcs(names)
    for registry in (math_eval.REWARD_FUNCS, REWARD_FUNCS):
        with pytest.raises(ValueError, match="Unknown reward function 'nope'.*'boxed_accuracy'"):
            reward_funcs.resolve(["nope"], registry)


def test_evaluation_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        evaluate_command.main(["--model", "/nonexistent/model", "--dataset", "/nonexistent/problems.jsonl"])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--batch_size", "-2"], "--batch_size must be >= 1"),  # drew no sample and reported avg@k 0.0, exit 0
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--num_problems", "0"], "--num_problems must be >= 1"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top_p", "1.5"], "--top_p must be in (0, 1]"),
    (["--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16"),
    (["--output", "."], "--output '.' is a directory"),
    (["--output", "/nonexistent/folder/report.json"], "does not exist or is not writable"),
    (["--math_dataset_format", "gsmk8"], "--math_dataset_format: Unknown `math_dataset_format` 'gsmk8'"),
])
def test_evaluation_flags_that_cannot_give_a_report_are_refused_before_anything_loads(flags, named, capsys):
    """Each is named in one error, before the dataset or the model is read (both paths here do not exist: the flag's
    error comes first); the report's path is checked before the evaluation, not after it."""
    with pytest.raises(SystemExit) as exit_info:
        evaluate_command.main(["--model", "/nonexistent/model", "--dataset", "/nonexistent/problems.jsonl", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err and "does not exist\n" not in err, err


@pytest.mark.parametrize("name, flags, says", [
    ("problems.jsonl", ["--split", "test"], "`--dataset` '{path}' is a single file, which holds only the training "
     "split; evaluation (the 'test' split, from `--split`) needs a dataset with that split"),
    ("problems.txt", [], "`--dataset` file '{path}' must end in one of"),
])
def test_evaluation_dataset_errors_name_evaluates_flags(name, flags, says, tmp_path, capsys):
    """bapo evaluate's dataset mistakes name its own flags (they named bapo train's `dataset_name`,
    `dataset_test_split` and `--eval_strategy no`), before the model is read (it does not exist)."""
    path = tmp_path / name
    path.write_text('{"problem": "1+1", "answer": "2"}\n')
    with pytest.raises(SystemExit) as exit_info:
        evaluate_command.main(["--model", "/nonexistent/model", "--dataset", str(path), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says.format(path=path) in err, err
    assert "dataset_name" not in err and "eval_strategy" not in err and "dataset_test_split" not in err


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_recipes_parse_and_are_consistent(recipe):
    argv = ["--config", str(recipe)]
    gpu = not yaml.safe_load(recipe.read_text()).get("use_cpu")
    if gpu:  # a GPU recipe: on this CPU machine check everything but the precision flags
        argv += ["--bf16", "false", "--use_cpu", "true"]
    script_args, training_args, model_args = parse_args(argv)
    assert script_args.math_dataset_format and training_args.output_dir
    funcs = resolve_reward_funcs(script_args.reward_funcs)  # every reward name exists
    assert len(funcs) == len(training_args.reward_weights or funcs)
    for name in script_args.reward_funcs:  # the overlong penalty's L_max is the recipe's response budget
        if name in SOFT_OVERLONG:
            assert SOFT_OVERLONG[name][0] == training_args.max_completion_length
    assert training_args.positive_contribution_target == 0.4
    assert (training_args.ratio_lower_start, training_args.ratio_lower_max) == (0.6, 0.9)
    assert (training_args.ratio_upper_start, training_args.ratio_upper_max) == (1.2, 3.0)
    assert (training_args.ratio_lower_step, training_args.ratio_upper_step) == (0.02, 0.05)
    if not gpu:
        assert model_args.model_name_or_path is None and training_args.use_cpu and not training_args.bf16


def test_the_7b_recipe_is_the_papers_setting():
    script_args, args, model_args = parse_args(
        ["--config", str(REPO / "recipes" / "bapo_r1_distill_qwen_7b.yaml"), "--bf16", "false", "--use_cpu", "true"])
    assert model_args.model_name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert (args.max_completion_length, args.learning_rate, args.temperature) == (8192, 2e-6, 0.6)
    assert args.use_vllm and args.vllm_mode == "server" and args.beta == 0.0
    assert script_args.dataset_name == "Skywork/Skywork-OR1-RL-Data" and script_args.dataset_train_split == "math"


def test_the_cpu_recipe_prepares_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe's dataset path is relative to the repository root
    script_args, training_args, model_args = parse_args(
        ["--config", "recipes/cpu_smoke.yaml", "--output_dir", str(tmp_path)])
    reward_funcs, train, _ = prepare(script_args, training_args, model_args)
    assert len(reward_funcs) == 3 and len(train) == len(PROBLEMS.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_cpu_recipe_trains_two_steps(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "train_bapo.py", "--config", "recipes/cpu_smoke.yaml", "--max_steps", "2",
                           "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").exists()
    from support.run_logs import logged

    assert any("rewards/boxed_accuracy/mean" in e for e in logged(out)) and "BAPO run summary" in proc.stdout
    # the evaluation command on the training checkpoint, as a user would run it
    proc = subprocess.run([sys.executable, "-m", "bapo_trl.cli.evaluate", "--model", str(out / "checkpoint-2"),
                           "--dataset", "tests/data/math_problems.jsonl", "--k", "2", "--num_problems", "2",
                           "--max_new_tokens", "8", "--output", str(out / "eval.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "eval.json").read_text())["num_scored"] == 2 and '"avg@2"' in proc.stdout
