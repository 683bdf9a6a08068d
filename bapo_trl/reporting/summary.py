"""A short text summary of a BAPO run from ``trainer.state.log_history``: what a researcher checks first."""

from __future__ import annotations

import math
import os

from ..core.metrics import REWARDS, is_active


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def _cell(value, width: int, spec: str) -> str:
    """A table cell: the number, or ``-`` where it is undefined (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:{width}{spec}}"


def moved(entry: dict) -> float:
    return float(is_active(entry) and (entry.get("bapo/search_steps") or 0) > 0)


def generation_rows(log_history: list[dict]) -> list[dict]:
    """One row per generation: TRL logs ``reward`` on the step that generated a batch; the steps that train on
    the same batch follow it."""
    rows: list[dict] = []
    for entry in log_history:
        if "loss" not in entry:
            continue
        if "reward" in entry or not rows:
            rows.append({"first_step": entry.get("step"), "reward": entry.get("reward"), "entries": []})
        rows[-1]["entries"].append(entry)
    for row in rows:
        entries = row.pop("entries")
        row["last_step"] = entries[-1].get("step")
        active = [e for e in entries if is_active(e)]  # the window only means something where it mattered
        for key in ("bapo/clip_low", "bapo/clip_high", "bapo/positive_contribution", "bapo/target_met"):
            row[key] = _mean([e.get(key) for e in active])
        row["entropy"] = _mean([e.get("entropy") for e in entries])
        row["bounds_moved"] = _mean([moved(e) for e in entries])
    return rows


def reward_batches(log_history: list[dict]) -> tuple[int, int] | None:
    """``(generation batches scored, those without any reward)`` over the run (:data:`~bapo_trl.core.metrics.REWARDS`,
    totals in the last entry that logs them); None when no entry does (a log written before they existed)."""
    last = next((h for h in reversed(log_history) if h.get(REWARDS[0]) is not None), None)
    return None if last is None else (int(last[REWARDS[0]]), int(last.get(REWARDS[1]) or 0))


def _reward_line(log_history: list[dict]) -> list[str]:
    counts = reward_batches(log_history)
    if counts is None:
        return []
    scored, without = counts
    share = f"{100 * without / scored:.0f}%" if scored else "-"
    line = f"generation batches with no reward (every reward function returned None): {without} of {scored} ({share})"
    return [line + (": they train nothing." if without else ".")]


def run_problems(log_history: list[dict], args=None) -> list[str]:
    """What makes a finished run a failed one (``bapo train`` exits non-zero on any): no generation batch with a
    reward (nothing was trained). Empty: none. A run that trained but logged no step is not a failure: its model is
    saved; ``BAPOConfig`` warns before any work when ``logging_steps`` exceeds ``max_steps``."""
    problems = []
    counts = reward_batches(log_history)
    if counts is not None and counts[0] and counts[0] == counts[1]:
        problems.append(f"no generation batch had a reward: in all {counts[0]}, every reward function returned None "
                        "for every completion, so every advantage was 0 and nothing was trained. Return a float for "
                        "the completions a reward function scores.")
    return problems


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def format_summary(log_history: list[dict], args=None, max_rows: int = 12) -> str:
    """Reward per generation batch (every one, or every k-th and the last when there are more than ``max_rows``: the
    heading says which), mean bounds and positive share, the reward at the start, its best batch and at the end, how
    often BAPO's window differed from GRPO's (the start window), and the share of generation batches without any
    reward."""
    rows = generation_rows(log_history)
    if not rows:
        return "\n".join(["No training steps were logged."] + _reward_line(log_history))
    stride = max(1, math.ceil(len(rows) / max_rows))
    shown = rows[::stride]
    last = "" if shown[-1] is rows[-1] else " and the last"
    if last:
        shown.append(rows[-1])
    if stride == 1:
        which = f"one row per generation batch, all {len(rows)}"
    else:
        which = f"{len(shown)} of the {len(rows)} generation batches: every {_ordinal(stride)}{last}"
    lines = [
        f"BAPO run summary ({which}; each row: means over the steps trained on that batch, the window and shares "
        "over those where the search was active, - where none was)",
        f"{'steps':>11} {'reward':>7} {'c_low':>6} {'c_high':>6} {'pos.share':>9} "
        f"{'met':>5} {'moved':>5} {'entropy':>7}",
    ]
    for r in shown:
        steps = f"{r['first_step']}-{r['last_step']}"
        lines.append(
            f"{steps:>11} {_cell(r['reward'], 7, '.3f')} "
            f"{_cell(r['bapo/clip_low'], 6, '.3f')} {_cell(r['bapo/clip_high'], 6, '.3f')} "
            f"{_cell(r['bapo/positive_contribution'], 9, '.3f')} {_cell(r['bapo/target_met'], 5, '.2f')} "
            f"{_cell(r['bounds_moved'], 5, '.2f')} {_cell(r['entropy'], 7, '.3f')}"
        )
    train = [e for e in log_history if "loss" in e]
    active = [e for e in train if is_active(e)]
    quarter = max(1, len(rows) // 4)
    first = _mean([r["reward"] for r in rows[:quarter]])
    last = _mean([r["reward"] for r in rows[-quarter:]])
    target = f" (target {args.positive_contribution_target})" if args is not None else ""
    if active:
        search = (
            f"search active (some window on the path changes the loss) in {100 * len(active) / len(train):.0f}% of "
            f"updates; over those: mean bounds [{_mean([e.get('bapo/clip_low') for e in active]):.3f}, "
            f"{_mean([e.get('bapo/clip_high') for e in active]):.3f}], "
            f"positive share {_mean([e.get('bapo/positive_contribution_before') for e in active]):.3f} at the start "
            f"bounds -> {_mean([e.get('bapo/positive_contribution') for e in active]):.3f} chosen{target}"
        )
    else:  # no update had a ratio past a window on the search path (on-policy data): no bounds to average
        search = (f"search never active (no window on the path changed the loss in any of the {len(train)} updates: "
                  f"the data was on-policy or the ratios stayed inside the start window){target}")
    scored = [r for r in rows if r["reward"] is not None and not math.isnan(r["reward"])]
    best = max(scored, key=lambda r: r["reward"]) if scored else None
    peak = f"best {best['reward']:.3f} (steps {best['first_step']}-{best['last_step']}), " if best else ""
    lines.append(
        f"reward (a generation batch's mean): start {first:.3f} (first quarter of the batches), {peak}"
        f"end {last:.3f} (last quarter); {search}; bounds moved in {100 * _mean([moved(e) for e in train]):.0f}% of "
        "updates (on the others the update was TRL's GRPO at the start window)."
    )
    return "\n".join(lines + _reward_line(log_history))


#: What ``bapo train`` leaves in its output folder, by name: said beside each entry of :func:`format_saved`.
SAVED_FILES = {
    "model.safetensors": "the trained weights",
    "adapter_model.safetensors": "the trained LoRA adapter (load it on the base model with peft)",
    "adapter_config.json": "the adapter's settings, with its base model",
    "config.json": "the model's configuration",
    "generation_config.json": "the model's generation defaults",
    "tokenizer.json": "the tokenizer",
    "tokenizer_config.json": "the tokenizer's settings",
    "chat_template.jinja": "the chat template",
    "special_tokens_map.json": "the tokenizer's special tokens",
    "vocab.json": "the tokenizer's vocabulary",
    "merges.txt": "the tokenizer's merges",
    "added_tokens.json": "the tokenizer's added tokens",
    "README.md": "the model card: base model, BAPO settings and what the search did",
    "training_args.bin": "the BAPOConfig of the run (torch.load)",
    "dynamics.png": "reward, entropy, bounds, positive share, clipping, staleness (redraw: bapo plot {folder})",
    "bapo_log_history.json": "every logged step's metrics (bapo plot reads it)",
    "metrics.jsonl": "every logged entry, one JSON line each, written as the run went",
    "trainer_state.json": "the trainer's state and log history",
    "launch_info": "each process's device, precision and launch (one JSON per rank)",
}


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    from ..generation.weight_files import directory_bytes  # the push's own count of a folder's bytes

    return directory_bytes(path)


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def format_saved(output_dir: str) -> str:
    """Where a finished run saved, and what is there: one line per file or folder of ``output_dir`` with its size
    and, for what ``bapo train`` writes, what it is (:data:`SAVED_FILES`; ``checkpoint-N`` folders too)."""
    folder = os.path.abspath(output_dir)
    if not os.path.isdir(folder):
        return f"[bapo_trl] nothing was saved: {folder} does not exist."
    names = sorted(os.listdir(folder), key=lambda n: (n.startswith("checkpoint-"), n))
    if not names:
        return f"[bapo_trl] nothing was saved in {folder} (the folder is empty)."
    entries = []
    for name in names:
        path = os.path.join(folder, name)
        label = name + ("/" if os.path.isdir(path) else "")
        what = SAVED_FILES.get(name, "").format(folder=folder)
        if not what and name.startswith("checkpoint-") and os.path.isdir(path):
            what = (f"the checkpoint of step {name.split('-', 1)[1]} (to train on from it: --resume_from_checkpoint "
                    f"{path} with a higher --max_steps)")
        entries.append((label, _human(_size(path)), what))
    width = max(len(label) for label, _, _ in entries)
    lines = [f"[bapo_trl] saved in {folder}:"]
    lines += [f"  {label:<{width}} {size:>9}  {what}".rstrip() for label, size, what in entries]
    return "\n".join(lines)
