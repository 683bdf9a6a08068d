"""Evidence on a real model (issue 45, item 4): the settings the tiny evidence study ranks highest against TRL's dapo
clip-higher and GSPO on SmolLM2-135M-Instruct, chat arithmetic, stale data, paired by seed, each method scored on a
held-out set of 96 problems (avg@8 and pass@8) with 95% bootstrap intervals.

    python benchmarks/evidence_smollm2.py --methods "BAPO paper + dual clip" "BAPO verl" ...   # + the two references
    python benchmarks/evidence_smollm2.py --report          # only read the runs file and write the report
    python benchmarks/evidence_smollm2.py --quick           # base + one method, 1 step, 2 problems, temp dir (CI)
    python benchmarks/evidence_smollm2.py --write-heldout   # rewrite tests/data/chat_arithmetic_heldout96.jsonl

Issue 53's stress study (docs/results.md, "The stress scenario"): very stale data at a high rate, 6 seeds:

    python benchmarks/evidence_smollm2.py --methods "BAPO paper + dual clip" "BAPO GSPO-scale x10" \
        --references "TRL dapo clip-higher" "TRL GSPO (documented)" --seeds 910-915 --staleness 16 --steps 32 \
        --lr 1e-4 --results docs/data/stress_smollm2_runs.jsonl --report-out docs/data/stress_smollm2.md

Methods: by name from the evidence study's methods (``study.evidence_methods``: the same trainer and settings as
the tiny study); TRL's dapo clip-higher and GSPO (``REFERENCES``, on TRL's own GRPOTrainer) always run, as the
references of the paired comparisons. ``--methods`` names the others; its default (``DEFAULT_METHODS``) is the three
settings the tiny study ranks highest. The published run (docs/data/evidence_smollm2.md) had ``BAPO GSPO`` (no dual
clip) too, for its first seed only.

Training (``study.train_smollm2``, which loss_study_smollm2.py runs too, so both SmolLM2 studies train alike): full
fine-tuning in float32 on CPU on the shipped training split (172 problems), transformers generation, 8 prompts x 4
samples x 16 tokens per generation, ``steps_per_generation=4`` (each batch trained on for 4 optimizer steps: up to 3
steps stale), batch 8 completions per step, lr 2e-5 (twice the README's recipe, so that the ratios leave 1 and the
windows matter: at this rate BAPO's upper bound reached 3.0 on two of the three stale steps of the first batch, seed
100), 16 steps (4 generation batches), one torch thread per run, two runs at a time. A seed fixes the prompts and their
order, so the methods of one seed differ only by what they do with the data (their first step is the same: measured,
equal reward and gradient norm).

Held-out set (``tests/data/chat_arithmetic_heldout96.jsonl``, written by ``--write-heldout``, checked by
tests/test_smollm2.py): the shipped chat arithmetic task's generator
(``bapo_trl.recipes.math_reasoning.chat_arithmetic``, its prompt, id and answer format) covers operands 1..12 and ships
all 220 of those problems as 48 test + 172 training, so 96 held-out problems cannot all come from that range. The set
is the 48 shipped test problems, then 48 problems of the same form with an operand of 13 or 14 (``a + b``, and
``a - b`` with ``a >= b``: 79 such problems, in a fixed shuffle, seed 0, the first 48): none is in the training split.
The report gives avg@8 over all 96 and over each half (in range / operands 13-14).

Evaluation: 8 samples per problem, 16 new tokens, temperature 1.0, seed 0, the model in float32, scored with the
training reward (``boxed_accuracy``); avg@8 and pass@8 as ``bapo_trl.cli.evaluate`` computes them (its
``summarize``: the unbiased pass@k estimator). The sampling is batched: 8 problems at a time, each prompt's prefix
run once and its cache copied to the 8 samples (``sample_batch``), which is the same distribution as ``evaluate``'s
sampler (one problem, 8 copies of the prompt) at about a third of the cost (sampling measured at 0.91-1.04 s of CPU
per problem against 3.1-3.6 s). Every evaluation checks it: the first sample of each prompt of the first batch is
re-scored by a plain forward pass (no padding, no cache) and the log-probabilities must agree within ``CHECK_ATOL``
(measured: 8e-5).

Sizing (measured 2026-11-26 on this 2-core machine, one torch thread, ``nice -n 10``, beside the tiny evidence
study on the other core; CPU seconds, as the wall clock there also counted other sessions' tests): one training run
of 4 steps (one generation batch: generation ~15 s, then 10.5-13.5 s per optimizer step) took 61 s (BAPO paper +
dual clip) and 65 s (TRL dapo clip-higher): ~16 s per step; the evaluation of 16 held-out problems took 21 s with
the model's load and the sampler check: ~1.15 s per problem, ~115 s for 96. One run of 16 steps: ~12 s set-up (a
fresh process per run) + 256 s training + ~115 s evaluation = ~6.4 min. 6 methods x 4 seeds = 24 runs + the base
evaluation (~2 min), two at a time: (24 x 6.4 + 2) / 2 + ~3 min for the last run alone = ~81 min. The 2-seed study
of ``loss_study_smollm2.py`` ran ~1.5x slower per unit than these measurements (its two SmolLM2 runs side by side,
2026-11-23: 24.5 s per step, 4.8 s per problem with ``evaluate``'s unbatched sampler); at that speed this study
would take ~2 hours, so on a machine shared with other heavy jobs pass ``--steps 12`` (~68 min measured, ~1.7 hours
at the slower speed). 20 steps, as in the 2-seed study, would take ~95 min measured and ~2.4 hours at the slower
speed, hence 16. Runs are appended as they finish and skipped when the file already holds them, so an interrupted
study continues with the same command.

Results: one JSON line per finished run (``--results``, default
``benchmarks/results/evidence_smollm2_runs.jsonl``: method, seed, trainer, settings, the training fields, commit,
seconds, avg@8 / pass@j over all problems and per half, each problem's number of correct samples, reward and
gradient norm per step). The report (``--report-out``, default ``docs/data/evidence_smollm2.md``): per method the mean
over seeds with a 95% percentile bootstrap interval, then every method's paired difference (same seed) from each
reference, its interval and ``study.verdict``. At a few seeds that interval is too narrow to carry a claim by
itself: the report says how often a true tie reads as beats or loses at its number of seeds
(``study.false_verdict_rate``: about 1 time in 5 at 4 seeds, 1 in 8 at 6), so a verdict here is a lead for more
seeds, and a table gives every seed's avg@8 and largest gradient norm. Training stability is paired the same way
(the largest gradient norm, the entropy of the last 8 steps; read higher / lower, never counted as claims), with the
share of updates BAPO's search moved the window, and a figure beside the report (``<report>_curves.png``: reward,
gradient norm and entropy per step, mean over seeds).
The last line is ``runs=.. base_avg8=.. claims=.. minutes=..``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import time

from study import (
    REPO,
    append_jsonl,
    bootstrap_ci,
    commit,
    evidence_methods,
    false_verdict_rate,
    fmt_seeds,
    mean,
    paired,
    parse_seeds,
    pyplot,
    read_jsonl,
    save_png,
    verdict,
)
from study import SMOLLM2_QUICK as QUICK_TRAINING
from study import SMOLLM2_TRAINING as LOSS_STUDY_TRAINING
from study import train_smollm2 as train

#: The paired comparisons' references: the TRL baseline BAPO's default replaces, and the strongest TRL loss as TRL
#: documents it (``TRL GSPO`` is the variant with epsilon 0.2 the first study ran).
REFERENCES = ("TRL dapo clip-higher", "TRL GSPO (documented)", "TRL GSPO")
#: The settings the tiny evidence study ranks highest (docs/results.md): BAPO's balance of GSPO with the dual clip,
#: BAPO's default (paper + dual clip) and the widest fixed window. (Its GSPO balance without the dual clip ties the
#: one with it there, and gave the same model on the one SmolLM2 seed it ran: left out.)
DEFAULT_METHODS = ("BAPO GSPO + dual clip", "BAPO paper + dual clip", "widest fixed [0.9,3.0]")
DEFAULT_SEEDS = "100-103"
STEPS = 16
TRAINING = dict(LOSS_STUDY_TRAINING, max_steps=STEPS)
HELDOUT = os.path.join(REPO, "tests", "data", "chat_arithmetic_heldout96.jsonl")
HELDOUT_SIZE = 96
#: Operands of the held-out problems beyond the shipped task's range (1..chat_arithmetic.MAX_OPERAND).
HELDOUT_MAX_OPERAND = 14
K, MAX_NEW_TOKENS, TEMPERATURE, EVAL_SEED = 8, 16, 1.0, 0
EVAL_BATCH = 8  # problems sampled together
CHECK_ATOL = 1e-3  # largest |log p| difference between the batched sampler and a plain forward pass
KEPT = ("reward", "grad_norm", "entropy", "bapo/clip_low", "bapo/clip_high", "bapo/search_active")
RESULTS = os.path.join(REPO, "benchmarks", "results", "evidence_smollm2_runs.jsonl")
REPORT = os.path.join(REPO, "docs", "data", "evidence_smollm2.md")
#: Paired figures: (title, record key).
FIGURES = (("avg@8", "avg8"), ("pass@8", "pass8"))
#: Training-stability figures, paired by seed as FIGURES are but read as higher / lower, not as a win: the largest
#: gradient norm of a run, and the policy's entropy over its last LATE_STEPS steps (near 0: the samples collapsed
#: onto one answer; rising: the model drifted towards noise).
STABILITY = (("max grad norm", "grad_norm_max"), ("entropy, last 8 steps", "entropy_late"))
LATE_STEPS = 8
#: No verdict from fewer paired seeds than the study runs (a method cut short after one seed has a zero-width
#: interval, which would read as a difference).
MIN_PAIRS = 4


# -- the held-out set ------------------------------------------------------------------------------------------------

def heldout_problems(size: int = HELDOUT_SIZE, seed: int = 0) -> list[dict]:
    """The shipped test split, then problems of the same form with an operand above the task's range (at most
    ``HELDOUT_MAX_OPERAND``) in a fixed shuffle, up to ``size``: none is in the training split."""
    from bapo_trl.recipes.math_reasoning import chat_arithmetic as task

    beyond = []
    for a in range(1, HELDOUT_MAX_OPERAND + 1):
        for b in range(1, HELDOUT_MAX_OPERAND + 1):
            for op, result in (("+", a + b), ("-", a - b)):
                if max(a, b) > task.MAX_OPERAND and not (op == "-" and a < b):
                    beyond.append(dict(id=f"{a}{op}{b}", prompt=task.make_prompt(a, op, b), answer=str(result)))
    random.Random(seed).shuffle(beyond)
    shipped = task.splits()["test"]
    if size > len(shipped) + len(beyond):
        raise ValueError(f"at most {len(shipped) + len(beyond)} held-out problems with operands up to "
                         f"{HELDOUT_MAX_OPERAND}")
    return shipped + beyond[: size - len(shipped)]


def write_heldout(path: str = HELDOUT) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in heldout_problems())
    return path


def load_heldout(path: str = HELDOUT) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# -- evaluation ------------------------------------------------------------------------------------------------------

def sample_batch(model, tokenizer, prompts: list, k: int, max_new_tokens: int, temperature: float) -> tuple:
    """``k`` samples of each chat prompt, the prompts left-padded into one batch, each prompt's prefix (all but its
    last token) run once and its cache repeated for the ``k`` samples. Returns the samples' texts and token ids (up
    to and with EOS) per prompt, and what :func:`check_batch` needs."""
    import torch

    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc.input_ids, enc.attention_mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() numbers left-padded prompts
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                       use_cache=True, logits_to_keep=1)
        cache_name = "cache" if hasattr(prefix, "cache") else "past_key_values"  # transformers 5 / 4
        cache = getattr(prefix, cache_name)
        cache.batch_repeat_interleave(k)
        out = model.generate(input_ids=ids.repeat_interleave(k, 0), attention_mask=mask.repeat_interleave(k, 0),
                             **{cache_name: cache}, max_new_tokens=max_new_tokens, do_sample=True,
                             temperature=temperature, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
                             output_logits=True, return_dict_in_generate=True)
    samples = []
    for row in out.sequences[:, ids.shape[1]:].tolist():
        if tokenizer.eos_token_id in row:  # keep the EOS, drop the padding after it (as evaluate.sample does)
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        samples.append(row)
    grouped = [samples[i * k:(i + 1) * k] for i in range(len(prompts))]
    texts = [[tokenizer.decode(row, skip_special_tokens=True) for row in group] for group in grouped]
    return texts, grouped, (ids, mask, samples, torch.stack(out.logits, 1))


def check_batch(model, tokenizer, k: int, checked) -> float:
    """Largest |log p| difference, over the first sample of each prompt, between the batched sampler's logits and a
    plain forward pass of that prompt and sample (no padding, no cache)."""
    import torch

    ids, mask, samples, logits = checked
    worst = 0.0
    for p in range(ids.shape[0]):
        prompt, sample = ids[p][mask[p].bool()], torch.tensor(samples[p * k], dtype=ids.dtype)
        if not len(sample):
            continue
        with torch.no_grad():
            plain = model(torch.cat([prompt, sample])[None]).logits[0, len(prompt) - 1:len(prompt) - 1 + len(sample)]
        batched = logits[p * k, :len(sample)].float()
        worst = max(worst, (plain.log_softmax(-1) - batched.log_softmax(-1)).abs().max().item())
    return worst


def evaluate(model_path: str, problems: list[dict], split_at: int) -> dict:
    """avg@8 / pass@j over ``problems`` and over each part (``[:split_at]``: the shipped test split, the rest:
    operands 13-14); each problem's number of correct samples; the sampler check."""
    import torch

    from bapo_trl.recipes.math_reasoning.evaluate import load_model, summarize
    from bapo_trl.recipes.math_reasoning.rewards import boxed_accuracy

    started = time.time()
    torch.manual_seed(EVAL_SEED)
    model, tokenizer = load_model(model_path, "float32", "cpu")
    correct, check = [], None
    for start in range(0, len(problems), EVAL_BATCH):
        rows = problems[start:start + EVAL_BATCH]
        texts, ids, checked = sample_batch(model, tokenizer, [r["prompt"] for r in rows], K, MAX_NEW_TOKENS,
                                           TEMPERATURE)
        if check is None:
            check = check_batch(model, tokenizer, K, checked)
            if not check <= CHECK_ATOL:
                raise RuntimeError(f"the batched sampler's log-probabilities differ from a plain forward pass by "
                                   f"{check:.2g} (> {CHECK_ATOL}): its padding or cache handling is wrong here")
        for row, row_texts, row_ids in zip(rows, texts, ids):
            scores = boxed_accuracy(prompts=[row["prompt"]] * K, completions=[[{"role": "assistant", "content": t}]
                                    for t in row_texts], completion_ids=row_ids, answer=[row["answer"]] * K)
            if any(s is None for s in scores):
                raise ValueError(f"problem {row['id']}: its answer {row['answer']!r} does not parse")
            correct.append(sum(s >= 0.5 for s in scores))
    parts = {"": correct, "_in_range": correct[:split_at], "_beyond": correct[split_at:]}
    metrics = {}
    for suffix, counts in parts.items():
        if counts:
            metrics.update({f"{key}{suffix}": value for key, value in summarize(counts, K).items()})
    return {**metrics, "correct": correct, "sampler_check": check, "eval_seconds": time.time() - started}


# -- runs -------------------------------------------------------------------------------------------------------------

def run_key(run: dict) -> tuple:
    """What identifies a run: the same method, seed, training fields and held-out set."""
    return run["method"], run["seed"], json.dumps(run["training"], sort_keys=True), run["heldout"]


def run_one(spec: dict) -> dict:
    """One seed of one method in a fresh process: train, evaluate, the record to append. ``base``: evaluate only."""
    import torch

    torch.set_num_threads(1)
    from bapo_trl.recipes.math_reasoning import chat_arithmetic
    from bapo_trl.recipes.models import prepare_model

    model_dir = prepare_model("smollm2")
    problems = load_heldout(os.path.join(REPO, spec["heldout"]))[: spec["num_problems"]]
    in_range = len(chat_arithmetic.splits()["test"])
    started = time.time()
    history, train_seconds = [], 0.0
    if spec["method"] == "base":
        result = evaluate(model_dir, problems, in_range)
    else:
        with tempfile.TemporaryDirectory() as out:
            trained, history = train(spec, model_dir, out, spec["training"])
            train_seconds = time.time() - started
            result = evaluate(trained, problems, in_range)
    history = [{k: h[k] for k in KEPT if k in h} for h in history]
    rewards = [h["reward"] for h in history if "reward" in h]  # one per generation batch
    norms = [h["grad_norm"] for h in history
             if isinstance(h.get("grad_norm"), float) and math.isfinite(h["grad_norm"])]
    clip_high = mean([h.get("bapo/clip_high") for h in history if h.get("bapo/search_active")])
    return {**spec, "seconds": round(time.time() - started, 1),
            "train_seconds": round(train_seconds, 1), **result,
            "avg8": result[f"avg@{K}"], "pass8": result[f"pass@{K}"],
            "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
            "grad_norm_max": max(norms, default=None),
            "clip_high": None if math.isnan(clip_high) else clip_high,
            "history": history}


def plan(methods: list[str], seeds: list[int], training: dict, heldout: str, num_problems: int | None) -> list[dict]:
    """The base model once, then seed by seed (outermost, so a study cut short leaves complete pairs) every method."""
    METHODS = evidence_methods()  # (imports TRL: kept out of the module's import, which tests do)
    common = dict(training=training, heldout=os.path.relpath(heldout, REPO), num_problems=num_problems)
    todo = [dict(method="base", seed=0, trainer=None, settings={}, trainer_kwargs={}, **common)]
    for seed in seeds:
        for method in methods:
            fields = METHODS[method]
            todo.append(dict(method=method, seed=seed, trainer=fields["trainer"], settings=dict(fields["settings"]),
                             trainer_kwargs=dict(fields.get("trainer_kwargs", {})), **common))
    return todo


def run_study(todo: list[dict], results: str, workers: int) -> int:
    """Run what ``results`` does not hold yet (``workers`` processes), one line appended per finished run."""
    done = {run_key(r) for r in read_jsonl(results)}
    todo = [dict(spec, commit=commit()) for spec in todo if run_key(spec) not in done]
    print(f"{len(done)} runs already in {results}; {len(todo)} to run", flush=True)
    if not todo:
        return 0
    with mp.get_context("spawn").Pool(min(workers, len(todo)), maxtasksperchild=1) as pool:  # fresh per run
        for i, run in enumerate(pool.imap_unordered(run_one, todo)):
            append_jsonl(results, run)
            print(f"[{i + 1}/{len(todo)}] seed {run['seed']:<3} {run['method']:<24} avg@8 {run['avg8']:.1f} "
                  f"pass@8 {run['pass8']:.1f} (train {run['train_seconds']:.0f} s, eval {run['eval_seconds']:.0f} s,"
                  f" sampler check {run['sampler_check']:.1e})", flush=True)
    return len(todo)


# -- the report -------------------------------------------------------------------------------------------------------

def plain(values: list, digits: int = 2) -> str:
    """The mean of the values that exist, ``-`` where none does (a TRL run has no BAPO window)."""
    values = [v for v in values if v is not None]
    return f"{mean(values):.{digits}f}" if values else "-"


def percent(values: list) -> str:
    """The mean of shares as a percentage, ``-`` where none applies (a TRL method has no search)."""
    values = [v for v in values if v is not None]
    return f"{100 * mean(values):.0f}%" if values else "-"


def with_interval(values: list[float], resamples: int, digits: int = 1) -> str:
    """``mean [low, high]``: the mean over seeds and its 95% percentile bootstrap interval."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    low, high = bootstrap_ci(values, resamples)
    return f"{mean(values):.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def logged(run: dict, key: str) -> list[float]:
    """The finite values of one logged metric over a run's steps (its ``history``), in step order."""
    return [h[key] for h in run.get("history") or []
            if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]


def late_entropy(run: dict) -> float | None:
    """The mean entropy of the run's last LATE_STEPS logged steps (None for the base model: it did not train)."""
    values = logged(run, "entropy")[-LATE_STEPS:]
    return mean(values) if values else None


def search_moved(run: dict) -> float | None:
    """The share of a BAPO run's updates whose search moved the window (``bapo/search_active``); None for TRL."""
    values = logged(run, "bapo/search_active")
    return mean(values) if values else None


def curves_figure(runs: list[dict], path: str, order: list[str]) -> None:
    """Sampled reward (logged once per generation batch), gradient norm and entropy per step, one line per method
    (mean over its seeds at each step every seed logged)."""
    plt = pyplot()
    panels = (("reward", "sampled reward (per generation batch)"), ("grad_norm", "gradient norm"),
              ("entropy", "entropy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.4))
    for ax, (key, title) in zip(axes, panels):
        for i, method in enumerate(order):
            by_step = [{step: h[key] for step, h in enumerate(r.get("history") or [], 1)
                        if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])}
                       for r in runs if r["method"] == method]
            steps = sorted(set.intersection(*(set(s) for s in by_step))) if by_step else []
            if steps:
                ax.plot(steps, [mean([s[t] for s in by_step]) for t in steps], marker="o" if key == "reward" else None,
                        color=plt.get_cmap("tab10")(i % 10), label=method)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=9)
    labelled = {}  # one legend entry per method, from whichever panel drew it
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    fig.legend(list(labelled.values()), list(labelled), loc="upper center", ncol=len(labelled), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    save_png(fig, path)


def report(runs: list[dict], results: str, resamples: int = 10000, references=REFERENCES,
           figure: str | None = None) -> tuple[str, int]:
    """The markdown report of a results file and the number of avg@8 / pass@8 intervals that exclude zero;
    ``figure``: also draw the per-step curves there (a PNG the report links)."""
    METHODS = evidence_methods()
    runs = [dict(r, entropy_late=late_entropy(r)) for r in runs]
    base = [r for r in runs if r["method"] == "base"]
    trained = [r for r in runs if r["method"] != "base"]
    order = [m for m in dict.fromkeys((*references, *METHODS)) if any(r["method"] == m for r in trained)]
    seeds = sorted({r["seed"] for r in trained})
    settings = sorted({json.dumps(r["training"], sort_keys=True) for r in runs})
    commits = sorted({r.get("commit") or "unknown" for r in runs})
    sizes = sorted({len(r["correct"]) for r in runs})
    lines = [
        "# Evidence on SmolLM2-135M-Instruct: chat arithmetic, stale data, paired by seed\n",
        "The model is the package registry's Q4_1 GGUF copy of SmolLM2-135M-Instruct, dequantised to float32 by "
        "`bapo models smollm2`: a 4-bit copy, so no score here is the published model's.\n",
        f"From `{os.path.relpath(results, REPO)}` ({len(runs)} runs, {sum(r['seconds'] for r in runs) / 3600:.1f} "
        f"hours of run time; code {', '.join(c[:12] for c in commits)}; {platform.machine()}, {os.cpu_count()} "
        f"cores, one torch thread per run), written by `python benchmarks/evidence_smollm2.py --report --results "
        f"{os.path.relpath(results, REPO)}` on {time.strftime('%Y-%m-%d')}. How the runs were made: "
        "`benchmarks/evidence_smollm2.py`'s docstring. Training fields: "
        + "; ".join(f"`{s}`" for s in settings) + f". Held-out: {'/'.join(map(str, sizes))} problems "
        f"(`{base[0]['heldout'] if base else trained[0]['heldout']}`: the 48 shipped test problems, then operands "
        f"13-14), {K} samples of {MAX_NEW_TOKENS} tokens at temperature {TEMPERATURE}, seed {EVAL_SEED}.\n",
        f"Each cell: the mean over seeds and its 95% percentile bootstrap interval ({resamples} resamples, seed 0). "
        "Paired: the mean over seeds of (method - reference) on the same seed, its interval, and `study.verdict` "
        f"(beats / loses where the interval excludes zero, else ties). With {len(seeds)} seeds the interval is too "
        f"narrow to carry a claim by itself: a true tie reads as beats or loses {false_verdict_rate(len(seeds)):.0%} "
        f"of the time (simulated: {len(seeds)} normal differences, 1000 trials, `study.false_verdict_rate`). Read a "
        "verdict as a lead for more seeds, and look at the seeds one by one. Many intervals are read at once, "
        "with no correction for multiple comparisons. The stability figures (largest gradient norm, entropy of the "
        f"last {LATE_STEPS} steps) are paired the same way and read higher / lower: neither is a win by itself.\n",
    ]
    if any(len(r["correct"]) < HELDOUT_SIZE for r in runs):
        lines.append("**Fewer held-out problems than the study's (a quick run): the numbers mean nothing.**\n")
    for r in base:
        part = lambda key: f"{r[key]:.1f}%" if r.get(key) is not None else "n/a"  # noqa: E731
        lines.append(f"Base model: avg@{K} {r['avg8']:.1f}%, pass@{K} {r['pass8']:.1f}% (avg@{K} in range "
                     f"{part(f'avg@{K}_in_range')}, operands 13-14 {part(f'avg@{K}_beyond')}).\n")
    lines += [f"## Per method (seeds {fmt_seeds(seeds)})\n",
              f"| method | trainer | seeds | avg@{K} (%) | pass@{K} (%) | avg@{K} in range | avg@{K} operands 13-14 | "
              f"train reward, first batch -> last | max grad norm | entropy, last {LATE_STEPS} steps | "
              "c_high (active updates) | updates the search moved | minutes per run |",
              "|" + "---|" * 13]
    for method in order:
        rs = [r for r in trained if r["method"] == method]
        col = lambda key, digits=1: with_interval([r.get(key) for r in rs], resamples, digits)  # noqa: E731
        lines.append(f"| {method} | {rs[0]['trainer']} | {len(rs)} | {col('avg8')} | {col('pass8')} | "
                     f"{col(f'avg@{K}_in_range')} | {col(f'avg@{K}_beyond')} | "
                     f"{mean([r['reward_first'] for r in rs]):.2f} -> {mean([r['reward_last'] for r in rs]):.2f} | "
                     f"{col('grad_norm_max')} | {col('entropy_late', 3)} | "
                     f"{plain([r['clip_high'] for r in rs])} | {percent([search_moved(r) for r in rs])} | "
                     f"{mean([r['seconds'] / 60 for r in rs]):.1f} |")
    # the seeds one by one: a mean over few seeds can be one seed's collapse
    by_seed = {(r["method"], r["seed"]): r for r in trained}
    cell = lambda method, seed: (  # noqa: E731
        f"{by_seed[method, seed]['avg8']:.1f} ({by_seed[method, seed]['grad_norm_max']:.1f})"
        if (method, seed) in by_seed else "-")
    lines += [f"\n## Per seed: avg@{K} (%) and, in brackets, the largest gradient norm\n",
              "| method | " + " | ".join(str(seed) for seed in seeds) + " |", "|" + "---|" * (1 + len(seeds)),
              *(f"| {method} | " + " | ".join(cell(method, seed) for seed in seeds) + " |" for method in order)]
    claims = []
    for reference in references:
        rows = []
        for method in order:
            if method == reference or reference not in order:
                continue
            cells, n = [], 0
            for title, key in FIGURES + STABILITY:
                values = {m: {r["seed"]: r[key] for r in trained if r["method"] == m and r.get(key) is not None}
                          for m in (method, reference)}
                c = paired(values, method, reference, resamples)
                n = max(n, c["n"])
                words = ("beats", "loses", "ties") if (title, key) in FIGURES else ("higher", "lower", "ties")
                word = verdict(c["low"], c["high"], words) if c["n"] >= MIN_PAIRS else f"(< {MIN_PAIRS} pairs)"
                digits = 3 if key == "entropy_late" else 1
                cells.append(f"{c['diff']:+.{digits}f} [{c['low']:+.{digits}f}, {c['high']:+.{digits}f}] {word}")
                if word in ("beats", "loses"):
                    claims.append(f"- **{method}** {word} {reference} on {title}: {cells[-1].rsplit(' ', 1)[0]} "
                                  f"({c['n']} paired seeds)")
            rows.append(f"| {method} | {n} | " + " | ".join(cells) + " |")
        if rows:
            lines += [f"\n## Against {reference} (paired by seed)\n",
                      "| method | n | " + " | ".join(f"Δ {t} [95% CI] verdict" for t, _ in FIGURES + STABILITY)
                      + " |", "|" + "---|" * (2 + len(FIGURES) + len(STABILITY)), *rows]
    lines += ["\n## Intervals that exclude zero (leads, at this number of seeds)\n", *(claims or ["None."])]
    if figure:
        curves_figure(trained, figure, order)
        lines += [f"\n## Per step\n\n![Sampled reward, gradient norm and entropy per step, mean over seeds]"
                  f"({os.path.basename(figure)})\n\nSampled reward, gradient norm and entropy per step: each "
                  "method's mean over its seeds (a collapse on one seed moves a mean line; the tables hold the "
                  "intervals).\n"]
    return "\n".join(lines) + "\n", len(claims)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help=f"methods of benchmarks/evidence_study.py besides {' and '.join(REFERENCES)}, which "
                        f"always run (default: {', '.join(DEFAULT_METHODS)})")
    parser.add_argument("--seeds", default=DEFAULT_SEEDS, help=f"A-B or a list 3,5,8 (default {DEFAULT_SEEDS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    parser.add_argument("--staleness", type=int, default=TRAINING["steps_per_generation"],
                        help="steps_per_generation: each generation batch is trained on for this many optimizer "
                        f"steps, its last step that many minus one stale (default {TRAINING['steps_per_generation']})")
    parser.add_argument("--lr", type=float, default=TRAINING["learning_rate"],
                        help=f"learning rate (default {TRAINING['learning_rate']:g})")
    parser.add_argument("--references", nargs="+", default=list(REFERENCES),
                        help=f"the methods every other is paired with; they always run (default: "
                        f"{', '.join(REFERENCES)})")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help=f"score on the first N held-out problems only (default all {HELDOUT_SIZE}; a pilot)")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time (default 2: one per core)")
    parser.add_argument("--results", default=None, help=f"runs file (default {os.path.relpath(RESULTS, REPO)})")
    parser.add_argument("--report", action="store_true", help="only read the runs file and write the report")
    parser.add_argument("--report-out", default=None, help=f"default {os.path.relpath(REPORT, REPO)}")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples (default 10000)")
    parser.add_argument("--quick", action="store_true", help="the base model and one method, 1 step, 2 problems, "
                        "in a temp dir unless --results / --report-out say otherwise (smoke)")
    parser.add_argument("--write-heldout", action="store_true", help=f"rewrite {os.path.relpath(HELDOUT, REPO)}")
    args = parser.parse_args(argv)
    if args.write_heldout:
        print(f"wrote {write_heldout()}")
        return 0
    METHODS = evidence_methods()

    unknown = [m for m in [*args.methods, *args.references] if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if args.steps < 1 or args.workers < 1 or args.resamples < 1 or args.staleness < 1:
        parser.error("--steps, --staleness, --workers and --resamples must be >= 1")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.eval_problems is not None and not 1 <= args.eval_problems <= HELDOUT_SIZE:
        parser.error(f"--eval-problems must be in 1..{HELDOUT_SIZE}, got {args.eval_problems}")
    try:
        seeds = parse_seeds(args.seeds, count=False)
    except ValueError as error:
        parser.error(str(error))
    methods = list(dict.fromkeys([*args.methods, *args.references]))
    tmp = tempfile.mkdtemp(prefix="evidence-smollm2-") if args.quick else None
    results = args.results or (os.path.join(tmp, "runs.jsonl") if args.quick else RESULTS)
    out = args.report_out or (os.path.join(tmp, "evidence_smollm2.md") if args.quick else REPORT)
    started = time.time()
    if not args.report:
        if args.quick:
            todo = plan(methods[:1], seeds[:1], QUICK_TRAINING, HELDOUT, 2)
        else:
            training = dict(TRAINING, max_steps=args.steps, steps_per_generation=args.staleness, learning_rate=args.lr)
            todo = plan(methods, seeds, training, HELDOUT, args.eval_problems)
        from bapo_trl.recipes.models import prepare_model

        prepare_model("smollm2")  # once, before the workers race for the cache
        run_study(todo, results, args.workers)
    runs = read_jsonl(results)
    if not runs:
        parser.error(f"no runs in {results}")
    text, claims = report(runs, results, args.resamples, args.references,
                          figure=os.path.splitext(out)[0] + "_curves.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}")
    base = mean([r["avg8"] for r in runs if r["method"] == "base"])
    print(f"runs={len(runs)} base_avg8={base:.1f} claims={claims} minutes={(time.time() - started) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
