"""Where training batches come from: rollout sources behind one contract (``contract.py``), reaching TRL through the
port the trainer gives them (:mod:`bapo_trl.trainer.trl_port`), chosen by name (``registry.py``).

* :class:`TRLGeneration` (``trl_generation.py``): TRL's own generation, the default;
* :class:`PartialRollout` (``partial.py``, over the pool in ``pool.py``): completions grow by a token budget per
  step and are trained once their group has finished;
* :class:`AsyncGeneration` (``async_generation.py``, over the producer thread and prompt stream of
  ``producer.py``): the vLLM server generates the next batches (up to ``max_staleness`` ahead) while the trainer
  trains; :class:`AsyncPartialRollout` (``async_partial.py``) grows partial rollouts there, one round ahead;
* :class:`ReplaySource` (``replay.py``, over the queue in ``replay_queue.py``): wraps any of them; past groups with
  their behaviour log-probs replace (or, with ``replay_saves_generation``, stand in for) part of each fresh batch.

Every source stamps each completion with the version of the policy that sampled it and keeps each token's behaviour
log-prob, so BAPO's search sees the real staleness. Names are imported lazily: importing the package loads nothing.
"""

from __future__ import annotations

from ..core.lazy import lazy_names

#: What a user writing or choosing a source needs: the contract, the registry and the built-in sources.
_EXPORTS = {
    "AsyncGeneration": "async_generation",
    "AsyncPartialRollout": "async_partial",
    "NothingInBackground": "contract",
    "PartialRollout": "partial",
    "ReadyCompletions": "contract",
    "ReplaySource": "replay",
    "RolloutSource": "contract",
    "SourceSettings": "settings",
    "TRLGeneration": "trl_generation",
    "TrainerPort": "contract",
    "register_source": "registry",
    "registered_sources": "registry",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
