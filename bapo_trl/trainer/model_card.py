"""The BAPO section of the model card: the run's settings and what its search did, appended to TRL's card.

It names the method once, plainly: BAPO here is Balanced Policy Optimization with Adaptive Clipping (Xi et al.,
arXiv 2510.18927), not the 2026 "Batch Adaptation Policy Optimization".
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module stays light: `bapo plot` reads rho0 back from a card with it
    from .bapo_config import BAPOConfig

#: The card row that holds rho0; `target_from_card` reads it back.
TARGET_ROW = "target share rho0"

PAPER_CITATION = (
    "@article{xi2025bapo,\n"
    "    title        = {{BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced Policy "
    "Optimization with Adaptive Clipping}},\n"
    "    author       = {Zhiheng Xi and others},\n"
    "    year         = 2025,\n"
    "    eprint       = {arXiv:2510.18927}\n"
    "}"
)
#: The paper TRL's model card cites (its ``_paper`` attribute, set on :class:`~.bapo_trainer.BAPOTrainer`).
PAPER = {"title": "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced Policy Optimization with "
         "Adaptive Clipping", "id": "2510.18927", "citation": PAPER_CITATION}

def target_from_card(text: str) -> float | None:
    """rho0 from the text of a model card this module wrote (None when the card has no BAPO section)."""
    found = re.search(rf"^\| {re.escape(TARGET_ROW)} \| ([0-9.eE+-]+) \|", text, flags=re.M)
    return float(found.group(1)) if found else None


def bapo_card_section(args: BAPOConfig, log_history: list[dict]) -> str:
    """Markdown: the BAPO settings of the run and the averages of its search, for the model card."""
    path = args.search_path
    rows = [
        ("variant", args.bapo_variant),
        ("positive contribution (rho) measured as", args.positive_contribution_mode),
        (TARGET_ROW, args.positive_contribution_target),
        ("c_low range / step",
         f"[{path['ratio_lower_start']}, {path['ratio_lower_max']}] / {path['ratio_lower_step']}"),
        ("c_high range / step",
         f"[{path['ratio_upper_start']}, {path['ratio_upper_max']}] / {path['ratio_upper_step']}"),
        ("steps_per_generation / num_iterations", f"{args.steps_per_generation} / {args.num_iterations}"),
        ("loss_type", args.loss_type),
    ]
    if args.replay_enabled:
        rows.append(("replay", f"{args.replay_buffer_size} groups, ratio {args.replay_ratio}, "
                               f"max staleness {args.replay_max_staleness}, {args.replay_sampling} sampling"))
    from ..core.metrics import is_active

    logged = [h for h in log_history if "bapo/clip_low" in h]
    steps = [h for h in logged if is_active(h)]  # means over the updates where the window mattered
    if logged:
        rows.append(("updates where some window changed the loss", f"{100 * len(steps) / len(logged):.0f}%"))
    if steps:
        mean = lambda k: sum(h[k] for h in steps if h.get(k) is not None) / max(  # noqa: E731
            1, sum(h.get(k) is not None for h in steps))
        rows += [
            ("mean chosen window", f"[{mean('bapo/clip_low'):.3f}, {mean('bapo/clip_high'):.3f}]"),
            ("mean positive share (chosen bounds)", f"{mean('bapo/positive_contribution'):.3f}"),
            ("updates meeting the target", f"{100 * mean('bapo/target_met'):.0f}%"),
        ]
    elif logged:
        rows.append(("mean chosen window", "none: no update where the window could change the loss (on-policy data)"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (
        "## BAPO\n\nTrained with BAPO (Balanced Policy Optimization with Adaptive Clipping, Xi et al., "
        "[arXiv 2510.18927](https://arxiv.org/abs/2510.18927); not the 2026 \"Batch Adaptation Policy "
        "Optimization\") via `bapo_trl`: the PPO clipping window was re-chosen at every update so that "
        "positive-advantage tokens keep a target share of the loss.\n\n"
        f"| setting | value |\n|---|---|\n{table}\n"
    )


#: What TRL's card's quick start loads when the run has no Hub id (``hub_model_id`` unset: nothing pushed).
NO_HUB_ID = 'model="None"'
#: What TRL's card template writes when it has no Hub id for the base model (a local directory, or no name at all).
NO_BASE_MODEL = "fine-tuned version of [None](https://huggingface.co/None)"


def quick_start_model(folder: str) -> str:
    """The card's quick start loading the saved ``folder`` (TRL's loads the Hub id, "None" when nothing is pushed)."""
    return f'model="{os.path.abspath(folder)}"'


def task_quick_start(text: str, prompt: str, max_new_tokens: int) -> str:
    """TRL's card ``text`` with its quick start asking the model a prompt of the task it was trained on, as plain
    text, greedily, within the run's completion length. TRL's asks a chat question: a model trained on plain-text
    prompts (the embedded reversal model: ``"123>"`` gives ``"321"``) answers it with nothing, past its context."""
    start = text.find("## Quick start")
    begin = text.find("```python", start)
    end = text.find("```", begin + len("```python"))
    model = re.search(r'model="[^"]*"', text[begin:end]) if min(start, begin, end) >= 0 else None
    if model is None:
        return text
    code = ("```python\nfrom transformers import pipeline\n\n"
            f"generator = pipeline(\"text-generation\", {model.group(0)})\n"
            f"output = generator({prompt!r}, max_new_tokens={max_new_tokens}, do_sample=False, "
            "return_full_text=False)[0]\n"
            "print(output[\"generated_text\"])\n")
    return text[:begin] + code + text[end:]


def name_base_model(text: str, base: str | None) -> str:
    """TRL's card ``text`` with the base model named where TRL names none: its card links a Hub id only, so for a model
    loaded from a local directory it writes "a fine-tuned version of [None]". The directory (``base``, the model
    config's ``name_or_path``) is named instead, or, when the model came without a name or path, that is said."""
    if NO_BASE_MODEL not in text:
        return text
    named = (f"fine-tuned version of the local model `{base}`" if base else
             "fine-tuned version of a model given as an object, with no name or path recorded in its config")
    return text.replace(NO_BASE_MODEL, named)


class ModelCardMixin:
    """Trainer overrides (before ``GRPOTrainer`` in the bases): every saved model, full or adapter, carries TRL's
    card with the BAPO section."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """TRL's save, then the model card (TRL's, with the BAPO section) beside the weights, full or adapter (PEFT
        writes a placeholder README.md there; the card replaces it). Checkpoints get theirs from TRL."""
        super().save_model(output_dir, _internal_call)
        if _internal_call or not self.args.should_save:
            return
        target = output_dir or self.args.output_dir
        self.create_model_card(model_name=os.path.basename(os.path.normpath(target)))
        card = os.path.join(self.args.output_dir, "README.md")
        if os.path.abspath(target) != os.path.abspath(self.args.output_dir) and os.path.exists(card):
            with open(card) as f:  # its quick start loads this folder
                text = f.read().replace(quick_start_model(self.args.output_dir), quick_start_model(target))
            with open(os.path.join(target, "README.md"), "w") as f:
                f.write(text)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's generated card (tags, citation of the paper), extended with a BAPO section; a base model loaded from a
        local directory is named by its path (:func:`name_base_model`)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.exists(path):
            return
        with open(path) as f:
            text = f.read()
        config = getattr(self.model, "config", None)
        base = getattr(config, "name_or_path", None) or None
        with open(path, "w") as f:
            text = text.replace(NO_HUB_ID, quick_start_model(self.args.output_dir))  # not pushed: the saved folder
            prompt = self._plain_text_prompt()
            if prompt is not None:  # a model of plain-text prompts: the quick start asks one of its task's
                text = task_quick_start(text, prompt, self.args.max_completion_length)
            f.write(name_base_model(text, base) + "\n" + bapo_card_section(self.args, self.state.log_history))

    def _plain_text_prompt(self) -> str | None:
        """The train set's first prompt when it is plain text (None for chat prompts, which TRL's card serves)."""
        dataset = getattr(self, "train_dataset", None)
        try:
            prompt = dataset[0]["prompt"]
        except (TypeError, KeyError, IndexError, NotImplementedError):
            return None
        return prompt if isinstance(prompt, str) else None
