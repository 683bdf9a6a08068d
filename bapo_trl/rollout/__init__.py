"""Where a training batch comes from besides TRL's own generation: the rollout sources ``BAPOTrainer`` holds.

Every source hands the trainer a batch in TRL's format in which each completion carries the version of the policy
that sampled it (``policy_version``; per token, ``token_policy_version``, when one completion spans several
policies) and each token the log-prob of that policy (``old_per_token_logps``), so BAPO's search sees the real
staleness; and each keeps its state for checkpoints (``state_dict()`` / ``load_state_dict()``, one file per
process). Async generation is to be one more source behind the same two promises.

* :class:`PartialRollout` (``partial.py``, over the pool in ``pool.py``): completions grow by a token budget per
  step and are trained once their group has finished;
* :class:`ReplayMixer` (``replay.py``, over the queue in ``queue.py``): past groups with their behaviour log-probs
  replace (or, with ``replay_saves_generation``, stand in for) part of each fresh batch.
"""

from .partial import PartialRollout
from .pool import PartialRolloutPool
from .queue import ReplayQueue
from .replay import ReplayMixer

__all__ = ["PartialRollout", "PartialRolloutPool", "ReplayMixer", "ReplayQueue"]
