"""The trainer, as TRL lays a trainer out: ``bapo_config.py`` (``BAPOConfig(GRPOConfig)``) and ``bapo_trainer.py``
(``BAPOTrainer(GRPOTrainer)``: the loss hook and the dispatcher), with the glue that works on the trainer object:

* ``loss_hook.py``: between TRL's policy forward and its clip: the tokens TRL's loss keeps, the ratios and weights the
  search balances, installing and restoring the window, the micro-batch's metrics (``LossHookMixin``);
* ``checkpoints.py``: complete-or-ignored checkpoints with the per-process rollout state;
* ``model_card.py``: TRL's model card with a BAPO section; ``reward_errors.py``: reward functions named in their
  errors; ``vllm_backend.py``: TRL's vLLM backend swapped for bapo_trl's (CPU machines, LoRA, seeds);
* ``loop_hooks.py``: a callback at each optimizer step, evaluation that leaves training's random state alone;
* ``option_groups.py``: the groups of the config's fields, as ``bapo train --help`` and the docs list them;
* ``trl_seams.py``: every private TRL name and override, checked when the trainer is imported.

Names load lazily: importing the config does not import the trainer (nor TRL's trainer).
"""

from ..core.lazy import lazy_names

_EXPORTS = {"BAPOConfig": "bapo_config", "BAPOTrainer": "bapo_trainer"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
