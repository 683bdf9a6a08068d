"""What every study of the embedded reversal task shares: the training run, its summary, tables, result files,
seed ranges and the paired bootstrap. One module, imported the same way (``from study import ...``; a script's own
directory is on ``sys.path``) by staleness_study, loss_study, entropy_clip_study, async_study, loss_study_smollm2,
evidence_study and evidence_smollm2, so a change to how a run is trained or summarised reaches every study at once.

It is also the home of what two studies share (the last section): the loss study's methods, the evidence study's
methods and the commit a run records, and the SmolLM2 training both SmolLM2 studies run. A study script imports
these from here, never from another study script (tests/test_benchmarks.py checks it): a library with no command,
beside ``server_bench.py`` (the server benchmarks' harness) and ``m2po.py`` (the M2PO baseline).
"""

from __future__ import annotations

import gzip
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
import time

# plain numbers: no torch, no TRL
from bapo_trl.experimental.gmpo.presets import GMPO_DOCUMENTED, gmpo_balanced
from bapo_trl.experimental.length_fair.presets import gspo_length_fair
from bapo_trl.reporting.summary import moved  # one definition of "the bounds moved"
from bapo_trl.trainer.presets import GSPO_DOCUMENTED, gspo_balanced

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLAPSE = 0.1  # final reward below this: the run collapsed


def window(low: float, high: float) -> dict:
    """A fixed clip window [low, high] as a BAPOConfig: a search path of one point (every run logs BAPO's metrics),
    with TRL's one-sided clip (no dual clip), as a fixed window runs in TRL."""
    return dict(ratio_lower_start=low, ratio_lower_max=low, ratio_upper_start=high, ratio_upper_max=high,
                dual_clip=False)


#: Fixed windows and BAPO variants (BAPOConfig fields) shared by the staleness, entropy-clip and async studies.
METHODS = {
    "fixed [0.8,1.2]": window(0.8, 1.2),
    "clip-higher [0.8,1.28]": window(0.8, 1.28),
    "fixed [0.8,1.5]": window(0.8, 1.5),
    "fixed [0.5,1.2]": window(0.5, 1.2),
    "widest fixed [0.9,3.0]": window(0.9, 3.0),
    "BAPO paper": dict(dual_clip=False),  # the paper's objective: no dual clip (BAPOConfig's default adds it)
    "BAPO gradient share": dict(positive_contribution_mode="gradient", dual_clip=False),
    "BAPO verl": dict(bapo_variant="verl"),
}
#: Tokens a completion may grow per step in the partial-rollout scenario: right answers are 4 tokens (3 digits +
#: EOS), wrong ones ramble on up to 12, so a budget of 4 pauses the long (wrong) completions; measured in the quick
#: check of evidence_study (``partial/carried``).
PARTIAL_BUDGET = 4
#: The off-policy scenario of a run (its ``staleness`` field): config fields on top of the method's. ``server``:
#: generation in a vLLM server (the run's ``server_url``); those scenarios and replay / partial rollout need
#: BAPOTrainer.
STALENESS = {
    "on-policy": dict(steps_per_generation=1),
    "spg 4": dict(steps_per_generation=4),
    "spg 8": dict(steps_per_generation=8),
    "spg 16": dict(steps_per_generation=16),
    "spg 32": dict(steps_per_generation=32),
    "replay 0.5": dict(steps_per_generation=1, replay_buffer_size=64, replay_ratio=0.5, replay_max_staleness=16),
    "partial rollout": dict(steps_per_generation=1, partial_rollout_budget=PARTIAL_BUDGET),
    "server sync": dict(steps_per_generation=4, server=True),
    "async K=1": dict(steps_per_generation=4, server=True, async_generation=True, max_staleness=1),
    "async K=2": dict(steps_per_generation=4, server=True, async_generation=True, max_staleness=2),
}
BAPO_ONLY = ("replay 0.5", "partial rollout", "server sync", "async K=1", "async K=2")
#: Trainers that cannot run the BAPO_ONLY scenarios (TRL's own, and M2PO on TRL's): a method on one of them runs
#: there as its BAPOTrainer-side twin (its ``bapo`` fields).
NOT_BAPO = ("trl", "m2po", "gmpo")
#: Per-step metrics kept in the runs files (enough to redo every table and figure).
KEPT = ("step", "loss", "grad_norm", "reward", "entropy", "bapo/clip_low", "bapo/clip_high",
        "bapo/positive_contribution", "bapo/positive_contribution_before", "bapo/clip_fraction_negative",
        "bapo/clip_fraction_positive", "bapo/target_met", "bapo/search_exhausted", "bapo/search_steps",
        "bapo/staleness_mean", "replay/fraction", "bapo/positive_contribution_target", "entropy_clip/predicted_change",
        "entropy_clip/predicted_change_all", "entropy_clip/clip_effect", "entropy_clip/clipped_pos_low",
        "entropy_clip/clipped_pos_high", "entropy_clip/clipped_neg_low", "entropy_clip/clipped_neg_high",
        "m2po/masked_fraction", "partial/carried", "bapo/staleness_max")
#: The training every study shares: batch 32 completions (4 prompts x 8), 12 tokens, constant learning rate.
TRAINING = dict(use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
                disable_tqdm=True, logging_steps=1, per_device_train_batch_size=32, num_generations=8,
                max_completion_length=12, temperature=1.0, lr_scheduler_type="constant")


#: The studies' tasks (a run's ``task`` field; a run without one ran the first, the published task): the toy task's
#: digit range, the tiny model's warm start (``build_tiny_model``'s arguments), the completion budget, the tokens a
#: partial rollout grows per step and the held-out evaluation's token budget. The variable-length task: 2-8 digits
#: (answers 3-9 tokens with EOS, a ramble after an 8-digit answer up to 15, so 16 tokens), its own model warm-started
#: 800 steps (80 teach it 2-digit answers only; after 800 its sampled reward is about the 3-digit model's, 0.25-0.3);
#: partial rollout grows 6 tokens per step (5 digits and EOS, the median answer: longer answers are paused too).
TASKS = {
    "reverse3": dict(digits=(3, 3), model=dict(), max_completion_length=TRAINING["max_completion_length"],
                     partial_budget=PARTIAL_BUDGET, eval_tokens=10),
    "reverse2-8": dict(digits=(2, 8), model=dict(digits=(2, 8), warm_start_steps=800), max_completion_length=16,
                       partial_budget=6, eval_tokens=16),
}
DEFAULT_TASK = "reverse3"


def task_of(run: dict) -> str:
    """A run's task: its ``task`` field, else the published 3-digit task."""
    return run.get("task") or DEFAULT_TASK


def task_model(task: str = DEFAULT_TASK) -> str:
    """The warm-started tiny model of a task (built once, then cached)."""
    from bapo_trl.recipes.toy import build_tiny_model

    return build_tiny_model(**TASKS[task]["model"])


def parse_seeds(text: str | int, count: bool = True) -> list[int]:
    """``"A-B"`` -> seeds A..B (inclusive); ``"3,5,8"`` -> those seeds; ``"N"`` -> seeds 0..N-1 (only with
    ``count``: the older studies' ``--seeds N``; elsewhere a bare 100 would silently mean seeds 0-99)."""
    text = str(text).strip()
    try:
        if not count and text.isdigit():
            seeds = []
        elif "," in text:
            seeds = [int(s) for s in text.split(",")]
        elif "-" in text.lstrip("-"):
            first, last = text.split("-")
            seeds = list(range(int(first), int(last) + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ValueError(f"--seeds: expected A-B (e.g. 100-119; one seed: 100-100), a list 3,5,8"
                         f"{', or N (seeds 0..N-1)' if count else ''}; got {text!r}")
    return seeds


def seed_tag(seeds: str | None) -> str:
    """File-name suffix of a ``--seeds`` re-run (``_seeds100-119``), so it never overwrites the published files."""
    return f"_seeds{seeds}".replace(",", "_") if seeds else ""


def trainer_classes(kind: str):
    """``(config class, trainer class)`` of a run's ``trainer`` field: ``"bapo"`` (default), ``"trl"`` (TRL's own
    GRPOConfig / GRPOTrainer), ``"m2po"`` (M2PO on TRL's trainer), ``"m2po-bapo"`` (M2PO on BAPOTrainer), ``"gmpo"``
    (TRL's experimental GMPOConfig / GMPOTrainer), and the research candidates of ``bapo_trl.experimental``:
    ``"bapo-gmpo"`` (BAPOGMPOTrainer), ``"bapo-decoupled"`` and ``"bapo-length-fair"``."""
    from trl import GRPOConfig

    from bapo_trl import BAPOConfig, BAPOTrainer

    if kind == "trl":
        from trl import GRPOTrainer

        return GRPOConfig, GRPOTrainer
    if kind == "m2po":
        from m2po import M2POTrainer

        return GRPOConfig, M2POTrainer
    if kind == "m2po-bapo":
        from m2po import bapo_trainer_class

        return BAPOConfig, bapo_trainer_class()
    if kind == "gmpo":
        # first bapo_trl's module, which imports TRL's experimental GMPO with its notice silenced (once a process)
        from bapo_trl.experimental.gmpo import trainer as gmpo  # noqa: I001
        from trl.experimental.gmpo import GMPOConfig

        return GMPOConfig, gmpo.GMPOTrainer
    if kind == "bapo-gmpo":
        from bapo_trl.experimental.gmpo import BAPOGMPOTrainer, GMPOBAPOConfig

        return GMPOBAPOConfig, BAPOGMPOTrainer
    if kind == "bapo-decoupled":
        from bapo_trl.experimental.decoupled import DecoupledBAPOConfig, DecoupledBAPOTrainer

        return DecoupledBAPOConfig, DecoupledBAPOTrainer
    if kind == "bapo-length-fair":
        from bapo_trl.experimental.length_fair import LengthFairBAPOConfig, LengthFairBAPOTrainer

        return LengthFairBAPOConfig, LengthFairBAPOTrainer
    if kind in (None, "bapo"):
        return BAPOConfig, BAPOTrainer
    raise ValueError(f"unknown trainer {kind!r}")


def run_one(spec: dict) -> dict:
    """One training run (one torch thread): its per-step history and a summary. ``spec``: method, staleness, lr,
    seed, steps; optional ``settings`` (config fields; default: ``METHODS[method]``), ``trainer`` (see
    :func:`trainer_classes`), ``trainer_kwargs``, ``extra_metrics`` (kept besides KEPT), ``server_url`` (the
    server scenarios), ``task`` (a key of :data:`TASKS`; default the published 3-digit task). Every method run with
    one seed sees the same prompts in the same order (the dataset and TRL's sampler are seeded by it).
    ``step_seconds``: wall-clock from the start of training to the end of each step."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer, TrainerCallback

    from bapo_trl.recipes.toy import evaluate_accuracy, make_reverse_dataset, reverse_reward

    task = TASKS[task_of(spec)]
    kind = spec.get("trainer", "bapo")
    if kind in NOT_BAPO and spec["staleness"] in BAPO_ONLY:
        raise ValueError(f"{spec['staleness']} needs BAPOTrainer's rollouts; {spec['method']} runs on TRL's trainer")
    config_cls, trainer_cls = trainer_classes(kind)
    kept = KEPT + tuple(spec.get("extra_metrics", ()))
    scenario = dict(STALENESS[spec["staleness"]])
    if "partial_rollout_budget" in scenario:
        scenario["partial_rollout_budget"] = task["partial_budget"]
    if scenario.pop("server", False):
        scenario.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=spec["server_url"],
                        vllm_server_timeout=120)
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    model_dir = task_model(task_of(spec))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    training = dict(TRAINING, max_completion_length=task["max_completion_length"])
    started = time.time()
    with tempfile.TemporaryDirectory() as out:
        args = config_cls(output_dir=out, learning_rate=spec["lr"], seed=spec["seed"], max_steps=spec["steps"],
                          **training, **spec.get("settings", METHODS.get(spec["method"], {})), **scenario)
        trainer = trainer_cls(model=model_dir, reward_funcs=reverse_reward, args=args, callbacks=[Clock()],
                              train_dataset=make_reverse_dataset(8192, seed=spec["seed"], digits=task["digits"]),
                              processing_class=tokenizer, **spec.get("trainer_kwargs", {}))
        start = time.perf_counter()
        trainer.train()
        accuracy = evaluate_accuracy(trainer.model, tokenizer,
                                     make_reverse_dataset(200, seed=1, split="test", digits=task["digits"]),
                                     max_new_tokens=task["eval_tokens"])
    history = [{k: v for k, v in h.items() if k in kept} for h in trainer.state.log_history if "loss" in h]
    return {**spec, "history": history, "heldout_accuracy": accuracy, "seconds": time.time() - started,
            "step_seconds": [t - start for t in ends]}


def mean(values) -> float:
    """Mean of the finite values (None and NaN left out); NaN when none."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def summarize(run: dict) -> dict:
    """One run's figures. Final reward: mean sampled reward over the last 20% of steps."""
    h = run["history"]
    rewards = [e["reward"] for e in h if "reward" in e]
    tail = h[int(len(h) * 0.8):]  # the last 20% of steps
    return {
        "reward_first": rewards[0] if rewards else float("nan"),
        "reward_final": mean([e.get("reward") for e in tail]) if any("reward" in e for e in tail) else rewards[-1],
        "heldout_accuracy": run["heldout_accuracy"],
        "entropy_final": mean([e.get("entropy") for e in tail]),
        "positive_share": mean([e.get("bapo/positive_contribution") for e in h]),
        "clip_low": mean([e.get("bapo/clip_low") for e in h]),
        "clip_high": mean([e.get("bapo/clip_high") for e in h]),
        "clip_frac_neg": mean([e.get("bapo/clip_fraction_negative") for e in h]),
        "clip_frac_pos": mean([e.get("bapo/clip_fraction_positive") for e in h]),
        "target_met": mean([e.get("bapo/target_met") for e in h]),
        "exhausted": mean([e.get("bapo/search_exhausted") for e in h]),
        "moved": mean([moved(e) for e in h]),  # inactive updates (nothing on the path changes the loss) excluded
        "grad_norm_max": max((e.get("grad_norm", 0) for e in h), default=float("nan")),
        "m2po_masked": mean([e.get("m2po/masked_fraction") for e in h]),
        "partial_carried": mean([e.get("partial/carried") for e in h]),
    }


def fmt(values, digits=2) -> str:
    """``mean ± sd`` of the finite values (one value: itself; none: n/a)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(runs, rows_key, filter_fn, columns) -> str:
    """Markdown table, one row per value of ``rows_key`` among the runs ``filter_fn`` keeps: n, each column's
    ``mean ± sd`` over the runs (``(title, summary key[, digits])``), and how many collapsed."""
    groups: dict = {}
    for run in runs:
        if filter_fn(run):
            groups.setdefault(run[rows_key], []).append(run)
    header = f"| {rows_key} | n | " + " | ".join(c[0] for c in columns) + " | collapsed |"
    lines = [header, "|" + "---|" * (len(columns) + 3)]
    for key, members in groups.items():
        sums = [summarize(m) for m in members]
        cells = [fmt([s[c[1]] for s in sums], c[2] if len(c) > 2 else 2) for c in columns]
        collapsed = sum(s["reward_final"] < COLLAPSE for s in sums)
        lines.append(f"| {key} | {len(members)} | " + " | ".join(cells) + f" | {collapsed} |")
    return "\n".join(lines)


# -- result files ------------------------------------------------------------------------------------------------

def run_key(run: dict) -> tuple:
    """What identifies a run: the same key in two files is the same training run. A run of another task than the
    published one has its task in its key (the published runs' keys are the five fields they always were)."""
    key = run["method"], run["staleness"], run["lr"], run["seed"], run["steps"]
    return key if task_of(run) == DEFAULT_TASK else (*key, task_of(run))


def save_runs(runs: list[dict], path: str) -> None:
    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        json.dump(runs, f)


def load_runs(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def reuse(todo: list[dict], path: str | None) -> tuple[list[dict], list[dict]]:
    """``(runs of path that todo wants, the rest of todo)``: an earlier runs file's runs are not run again."""
    if not path:
        return [], todo
    wanted = {run_key(r) for r in todo}
    kept = [r for r in load_runs(path) if run_key(r) in wanted]
    done = {run_key(r) for r in kept}
    print(f"reusing {len(kept)} runs from {path}; {len(todo) - len(done)} to run")
    return kept, [r for r in todo if run_key(r) not in done]


def append_jsonl(path: str, record: dict) -> None:
    """One finished run as one line, flushed at once (a study killed mid-way keeps every run it finished)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file (gzipped when the name ends in .gz: the published runs in docs/data); a torn
    last line (a run killed while writing) is ignored."""
    if not os.path.exists(path):
        return []
    records = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def run_all(todo: list[dict], workers: int, line) -> list[dict]:
    """Run ``todo`` (``workers`` processes; 1: in this process, in order) and print ``line(i, n, result)`` as each
    finishes; returns the results in the order they finished."""
    results = []
    if workers <= 1:
        outcomes = map(run_one, todo)
        for i, result in enumerate(outcomes):
            results.append(result)
            print(line(i, len(todo), result), flush=True)
        return results
    with mp.get_context("spawn").Pool(workers) as pool:
        for i, result in enumerate(pool.imap_unordered(run_one, todo)):
            results.append(result)
            print(line(i, len(todo), result), flush=True)
    return results


def output_dir(out: str | None, quick: bool, prefix: str) -> str:
    """``out``, else a temp dir in quick mode, else docs/data/."""
    path = out or (tempfile.mkdtemp(prefix=prefix) if quick else os.path.join(REPO, "docs", "data"))
    os.makedirs(path, exist_ok=True)
    return path


# -- paired comparisons --------------------------------------------------------------------------------------------

def bootstrap_ci(diffs: list[float], resamples: int = 10000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile bootstrap interval of the mean of ``diffs`` (resampled with replacement, fixed seed)."""
    import numpy as np

    if not diffs:
        return float("nan"), float("nan")
    values = np.asarray(diffs, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def false_verdict_rate(n: int, trials: int = 1000, resamples: int = 2000, seed: int = 1) -> float:
    """How often :func:`bootstrap_ci` over ``n`` paired differences of a true tie (normal, mean 0) excludes zero:
    the chance that a "beats" or "loses" at ``n`` seeds is a tie (simulated; a percentile interval over few seeds is
    too narrow, so this is well above 5% at small ``n``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    wrong = 0
    for _ in range(trials):
        low, high = bootstrap_ci(list(rng.normal(size=n)), resamples, seed=0)
        wrong += low > 0 or high < 0
    return wrong / trials


def verdict(low: float, high: float, words=("beats", "loses", "ties")) -> str:
    """``words[0]`` when the interval lies above zero, ``words[1]`` below, ``words[2]`` when it holds zero."""
    if math.isnan(low) or math.isnan(high):
        return "n/a"
    return words[0] if low > 0 else words[1] if high < 0 else words[2]


def paired(values: dict, method: str, reference: str, resamples: int = 10000, seed: int = 0) -> dict:
    """``values[method][seed]`` -> the paired comparison of ``method`` with ``reference`` over the seeds both ran:
    n, mean difference (method - reference), its bootstrap interval."""
    seeds = sorted(set(values.get(method, {})) & set(values.get(reference, {})))
    diffs = [values[method][s] - values[reference][s] for s in seeds]
    diffs = [d for d in diffs if not math.isnan(d)]
    low, high = bootstrap_ci(diffs, resamples, seed)
    return {"n": len(diffs), "diff": mean(diffs), "low": low, "high": high}


# -- what two studies share -------------------------------------------------------------------------------------------

def commit() -> str:
    """The code a run used: $BAPO_STUDY_COMMIT (a snapshot outside git), else git's HEAD (+ "-dirty")."""
    if os.environ.get("BAPO_STUDY_COMMIT"):
        return os.environ["BAPO_STUDY_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "bapo_trl", "benchmarks"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return (head or "unknown") + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def fmt_seeds(seeds: list[int]) -> str:
    """Seeds as ``--seeds`` takes them: ``100-119`` for a range, else ``3,5,8``."""
    if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
    return ",".join(map(str, seeds))


# -- figures ---------------------------------------------------------------------------------------------------------

#: Figures' resolution: a 11-inch-wide figure is 1100 pixels, saved as a palette PNG (well under 150 KB).
FIGURE_DPI = 100


def save_png(fig, path: str) -> None:
    """``fig`` as a 256-colour palette PNG (a fraction of matplotlib's RGBA file, the same picture to the eye)."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    plt.close(fig)
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=256).save(path, optimize=True)


def pyplot():
    """matplotlib's pyplot drawing to files only (the Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


#: The loss study's losses: TRL loss -> its settings (GRPOConfig fields), shared by the TRL run and the BAPO-balanced
#: run.
LOSSES = {
    "dapo": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "vespo": dict(loss_type="vespo"),
    "GSPO": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo + off-policy mask": dict(loss_type="dapo", off_policy_mask_threshold=0.5),
}
#: BAPO-only settings on top of every loss's: the balanced version of a TRL loss is that loss with BAPO's window and
#: nothing else (no dual clip, which BAPOConfig adds by default to the clipped losses).
BAPO_EXTRA: dict = dict(dual_clip=False)


def loss_methods() -> dict[str, dict]:
    """The loss study's methods (loss_study, loss_study_smollm2): name -> run fields (trainer, settings), TRL's
    run and BAPO's of every loss."""
    out = {}
    for loss, settings in LOSSES.items():
        out[f"TRL {loss}"] = dict(trainer="trl", settings=dict(settings))
        bapo = {k: v for k, v in settings.items() if not k.startswith("epsilon")}  # BAPO chooses the window itself
        if bapo.get("loss_type") == "cispo":  # BAPOConfig needs a cap above 1: 1.2 gives the paper's cap path, as run
            bapo["epsilon_high"] = 1.2
        out[f"BAPO {loss}"] = dict(trainer="bapo", settings={**bapo, **BAPO_EXTRA})
    return out


#: GSPO's settings in the evidence study (TRL's loss grpo with the sequence-level ratio); GSPO as TRL's
#: documentation gives it for the GSPO paper's setting is the library's (a named setting's path starts from it).
GSPO = dict(loss_type="grpo", importance_sampling_level="sequence")


def evidence_methods() -> dict[str, dict]:
    """The evidence study's methods (evidence_study, evidence_smollm2): name -> run fields; ``bapo`` (where given):
    the same method on BAPOTrainer for the scenarios only it runs. A function: M2PO's settings come from m2po.py,
    which imports TRL (a module importing this one need not)."""
    import m2po

    return {
        "TRL dapo clip-higher": dict(trainer="trl", settings=dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
                                     bapo=dict(trainer="bapo", settings=dict(loss_type="dapo", **window(0.8, 1.28)))),
        "TRL GSPO": dict(trainer="trl", settings=dict(GSPO, epsilon=0.2),  # a variant: epsilon 0.2 (TRL's default)
                         bapo=dict(trainer="bapo", settings=dict(GSPO, **window(0.8, 1.2)))),
        # GSPO as TRL documents it for the paper's setting (TRL's paper index): epsilon 3e-4 / 4e-4, beta 0
        "TRL GSPO (documented)": dict(trainer="trl", settings=dict(GSPO_DOCUMENTED),
                                      bapo=dict(trainer="bapo", settings=dict(GSPO, beta=0.0, **window(
                                          1 - GSPO_DOCUMENTED["epsilon"], 1 + GSPO_DOCUMENTED["epsilon_high"])))),
        "TRL vespo": dict(trainer="trl", settings=dict(loss_type="vespo")),
        "TRL cispo": dict(trainer="trl", settings=dict(loss_type="cispo", epsilon_high=5.0)),
        "widest fixed [0.9,3.0]": dict(trainer="bapo", settings=window(0.9, 3.0)),
        "M2PO": dict(trainer="m2po", settings=dict(m2po.SETTINGS), trainer_kwargs=dict(m2po_tau=m2po.TAU),
                     bapo=dict(trainer="m2po-bapo", settings=dict(m2po.BAPO_SETTINGS),
                               trainer_kwargs=dict(m2po_tau=m2po.TAU))),
        "BAPO paper": dict(trainer="bapo", settings=dict(dual_clip=False)),
        "BAPO paper + dual clip": dict(trainer="bapo", settings=dict(delta=3.0)),
        "BAPO verl": dict(trainer="bapo", settings=dict(bapo_variant="verl")),
        "BAPO GSPO": dict(trainer="bapo", settings=dict(GSPO, dual_clip=False)),
        "BAPO GSPO + dual clip": dict(trainer="bapo", settings=dict(GSPO, delta=3.0)),
        # issue 53's candidates (docs/data/candidate_protocol.md)
        "BAPO GSPO-scale x10": dict(trainer="bapo", settings=dict(GSPO_SCALE_X10)),
        "BAPO paper + dual clip + decoupled": dict(trainer="bapo-decoupled", settings=dict(delta=3.0)),
        "BAPO GSPO-scale x10 + decoupled": dict(trainer="bapo-decoupled", settings=dict(GSPO_SCALE_X10)),
        "M2PO then balance": dict(trainer="m2po-bapo", settings=dict(loss_type="dapo", delta=3.0),
                                  trainer_kwargs=dict(m2po_tau=m2po.TAU)),
        # a candidate after the first round's choice (issue 53's length-fair sequence balance; its own development
        # runs, docs/results.md): GSPO's ratio, each sequence's window k standard errors of its mean log-ratio
        "BAPO length-fair": dict(trainer="bapo-length-fair", settings=dict(gspo_length_fair(), **LENGTH_FAIR_WIDE)),
        # its band scaled to the documented GSPO's width (added on the development seeds after the default band,
        # 1-4 standard errors, gave half-widths ~1000x GSPO's and lost to gspo_balanced at staleness 32):
        # k_high 0.002-0.2, k_low 0.03 down to 0.0015 standard errors (gspo_balanced's ranges over a typical b ~ 0.3)
        "BAPO length-fair narrow": dict(trainer="bapo-length-fair", settings=gspo_length_fair()),  # its default band
        # a third round's candidate (issue 53's GMPO window; its protocol: docs/data/candidate_protocol.md): TRL's
        # experimental GMPO as TRL documents it (GMPOConfig's defaults: log-ratios clipped to [-0.4, 0.4] inside the
        # geometric mean), and BAPO's window on it from that start (gmpo_balanced)
        "TRL GMPO (documented)": dict(trainer="gmpo", settings=dict(GMPO_DOCUMENTED),
                                      bapo=dict(trainer="bapo-gmpo", settings=dict(gmpo_balanced(), **window(
                                          math.exp(-GMPO_DOCUMENTED["epsilon"]),
                                          math.exp(GMPO_DOCUMENTED["epsilon_high"]))))),
        "BAPO GMPO balanced": dict(trainer="bapo-gmpo", settings=gmpo_balanced()),
        # not a candidate (added after the development runs showed the decoupled default collapsing under replay and
        # partial rollout at lr 2e-3): tokens whose weight left [1/3, 3] are dropped (AReaL masks above its cap),
        # which gives back the protection the clip around the behaviour policy gave against very old tokens
        "BAPO paper + dual clip + decoupled mask": dict(trainer="bapo-decoupled", settings=dict(
            delta=3.0, off_policy_weight_mode="token_mask",
            off_policy_weight_floor=1 / 3, off_policy_weight_cap=3.0)),
        # issue 64's drop-in (benchmarks/dropin_study.py): BAPOConfig(**C) with nothing but C, the window rule's path;
        # its rivals TRL(C) are "TRL dapo clip-higher" and "TRL GSPO (documented)" above
        "BAPO(dapo clip-higher)": dict(trainer="bapo",
                                       settings=dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)),
        "BAPO(GSPO (documented))": dict(trainer="bapo", settings=dict(GSPO_DOCUMENTED)),
    }


#: The length-fair window's first band, 1 to 4 standard errors on both sides (dropped on the development seeds: its
#: half-widths were ~1000x GSPO's); LengthFairBAPOConfig's defaults are the band kept ("BAPO length-fair narrow").
LENGTH_FAIR_WIDE = dict(band_upper_start=1.0, band_upper_max=4.0, band_upper_step=0.25,
                        band_lower_start=4.0, band_lower_min=1.0, band_lower_step=0.25)
#: The candidate issue 53's development chose (x10 of the scales 1, 2, 4, 10, 25; seeds 100-104, staleness 32): the
#: library's named setting, so a user runs exactly what the study ran.
GSPO_SCALE_X10 = gspo_balanced(10)
#: The candidates of issue 53, in the protocol's order.
CANDIDATES = ("BAPO GSPO-scale x10", "BAPO paper + dual clip + decoupled", "BAPO GSPO-scale x10 + decoupled",
              "M2PO then balance")
#: The second round's (the length-fair window, built after the first round chose GSPO-scale x10): the same rule over
#: both tasks' cells (docs/data/candidate_protocol.md, "Second round").
SECOND_ROUND = ("BAPO GSPO-scale x10", "BAPO length-fair narrow")
#: The third round's (BAPO on GMPO, built after the second): the same rule over the same 14 cells, its candidate beside
#: both earlier picks (docs/data/candidate_protocol.md, "Third round").
THIRD_ROUND = ("BAPO GSPO-scale x10", "BAPO length-fair narrow", "BAPO GMPO balanced")


#: The SmolLM2 studies' training (loss_study_smollm2, evidence_smollm2): the shipped chat arithmetic training split.
SMOLLM2_TRAIN = os.path.join(REPO, "tests", "data", "chat_arithmetic_train.jsonl")
SMOLLM2_KEPT = ("step", "loss", "grad_norm", "reward", "entropy", "bapo/clip_low", "bapo/clip_high",
                "bapo/search_active", "bapo/positive_contribution", "bapo/target_met", "bapo/staleness_mean",
                "clip_ratio/region_mean", "cispo_clip_ratio", "bapo/search_exhausted", "bapo/sapo_temperature_pos",
                "bapo/sapo_temperature_neg", "bapo/vespo_k_pos", "bapo/vespo_lambda_pos", "bapo/vespo_k_neg",
                "bapo/vespo_lambda_neg")
# (bapo/clip_high is CISPO's cap where BAPO chooses it, docs/loss_types.md)
SMOLLM2_TRAINING = dict(per_device_train_batch_size=8, num_generations=4, steps_per_generation=4,
                        max_completion_length=16, temperature=1.0, learning_rate=2e-5, max_steps=20)
#: One generation of 4 (the quick runs).
SMOLLM2_QUICK = dict(SMOLLM2_TRAINING, per_device_train_batch_size=4, steps_per_generation=1, max_steps=1)


def train_smollm2(spec: dict, model_dir: str, out: str, training: dict) -> tuple[str, list[dict]]:
    """The SmolLM2 studies' training (loss_study_smollm2, evidence_smollm2, so both train alike): one seed of one
    method (``spec``: seed, and ``trainer`` / ``settings`` / ``trainer_kwargs`` as in :func:`trainer_classes`, else
    the method's fields in :func:`loss_methods`) on the shipped training split with ``training``'s config fields;
    returns the saved model's directory (under ``out``) and the kept history (``SMOLLM2_KEPT``)."""
    from transformers import AutoTokenizer

    from bapo_trl.cli.data import load_split, prepare_prompts
    from bapo_trl.recipes.math_reasoning.rewards import boxed_accuracy

    fields = spec if "settings" in spec else loss_methods()[spec["method"]]
    config_cls, trainer_cls = trainer_classes(fields["trainer"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = config_cls(output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                      save_strategy="no", disable_tqdm=True, logging_steps=1, seed=spec["seed"], **training,
                      **fields["settings"])
    trainer = trainer_cls(model=model_dir, reward_funcs=boxed_accuracy, args=args,
                          train_dataset=prepare_prompts(load_split(SMOLLM2_TRAIN, None, "train")),
                          processing_class=tokenizer, **fields.get("trainer_kwargs", {}))
    trainer.train()
    trained = os.path.join(out, "model")
    trainer.save_model(trained)
    tokenizer.save_pretrained(trained)
    history = [{k: v for k, v in h.items() if k in SMOLLM2_KEPT} for h in trainer.state.log_history if "loss" in h]
    return trained, history
