"""bapo_trl: BAPO (Balanced Policy Optimization with Adaptive Clipping) for TRL.

The public API is what this module exports (``__all__``):

* the method: ``BAPOConfig`` / ``BAPOTrainer`` subclass TRL's ``GRPOConfig`` / ``GRPOTrainer``; ``search_clip_bounds``
  is the bound search as a pure function (``BAPOSettings``, ``SearchResult``); ``gspo_balanced`` is a named setting
  (BAPO's balance of GSPO's sequence-level ratio around TRL's documented window; ``BAPOConfig(**gspo_balanced())``);
* research candidates that did not win live in :mod:`bapo_trl.experimental`;
* a run's results: ``PlotDynamicsCallback`` (the dynamics PNG at the end of training), ``plot_dynamics`` (the same
  figure from log histories or run directories, several overlaid), ``format_summary`` (the text summary ``bapo train``
  prints) and ``generation_rows`` (its rows: one per generation batch);
* the embedded task: ``build_tiny_model`` (a tiny model and tokenizer built offline and cached), the 3-digit reversal
  task ``make_reverse_dataset`` / ``reverse_reward`` and ``evaluate_accuracy`` (greedy exact match);
* a real model offline: ``prepare_model`` (a registry model such as ``"smollm2-135m-instruct"``, converted once),
  the shipped chat arithmetic task ``chat_arithmetic_splits`` and its reward ``boxed_accuracy``.

Every name is imported lazily, on first use: the math stays importable without loading TRL, and a command that needs
neither (``bapo plot``, ``bapo --help``) does not load torch.
"""

from .core.lazy import lazy_names

__version__ = "0.1.1"

#: public name -> where it lives: imported on first use (:mod:`.core.lazy`)
_EXPORTS = {
    "BAPOSettings": "bapo_trl.core.clipping",
    "SearchResult": "bapo_trl.core.clipping",
    "search_clip_bounds": "bapo_trl.core.clipping",
    "BAPOConfig": "bapo_trl.trainer.bapo_config",
    "BAPOTrainer": "bapo_trl.trainer.bapo_trainer",
    "gspo_balanced": "bapo_trl.trainer.presets",
    "PlotDynamicsCallback": "bapo_trl.reporting.callbacks",
    "plot_dynamics": "bapo_trl.reporting.dynamics",
    "format_summary": "bapo_trl.reporting.summary",
    "generation_rows": "bapo_trl.reporting.summary",
    "build_tiny_model": "bapo_trl.recipes.toy",
    "make_reverse_dataset": "bapo_trl.recipes.toy",
    "reverse_reward": "bapo_trl.recipes.toy",
    "evaluate_accuracy": "bapo_trl.recipes.toy",
    "prepare_model": "bapo_trl.recipes.models",
    "chat_arithmetic_splits": "bapo_trl.recipes.math_reasoning.chat_arithmetic:splits",
    "boxed_accuracy": "bapo_trl.recipes.math_reasoning.rewards",
}

__all__ = sorted(_EXPORTS) + ["__version__"]
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
