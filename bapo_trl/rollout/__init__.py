"""Where a training batch comes from besides TRL's own generation: the rollout sources ``BAPOTrainer`` holds.

Every source hands the trainer a batch in TRL's format in which each completion carries the version of the policy
that sampled it (``policy_version``; per token, ``token_policy_version``, when one completion spans several
policies) and each token the log-prob of that policy (``old_per_token_logps``), so BAPO's search sees the real
staleness; and each keeps its state for checkpoints (``state_dict()`` / ``load_state_dict()``, one file per
process). Completions generated outside TRL's generate call reach TRL's scoring through one
:class:`CompletionServer` (``serving.py``).

* :class:`PartialRollout` (``partial.py``, over the pool in ``pool.py``): completions grow by a token budget per
  step and are trained once their group has finished;
* :class:`AsyncGeneration` (``async_generation.py``): a producer thread has the vLLM server generate the next
  batches (up to ``max_staleness`` ahead) while the trainer trains; :class:`AsyncPartialRollout` grows partial
  rollouts there, one round ahead;
* :class:`ReplayMixer` (``replay.py``, over the queue in ``queue.py``): past groups with their behaviour log-probs
  replace (or, with ``replay_saves_generation``, stand in for) part of each fresh batch.
"""

from .async_generation import AsyncGeneration, AsyncPartialRollout
from .partial import PartialRollout
from .pool import PartialRolloutPool
from .queue import ReplayQueue
from .replay import ReplayMixer
from .serving import CompletionServer

__all__ = ["AsyncGeneration", "AsyncPartialRollout", "CompletionServer", "PartialRollout", "PartialRolloutPool", "ReplayMixer", "ReplayQueue", "check_rollout_arguments"]


def _is_iterable_dataset(dataset) -> bool:
    import datasets
    import torch

    return isinstance(dataset, (torch.utils.data.IterableDataset, datasets.IterableDataset))


def check_rollout_arguments(args, kwargs: dict) -> None:
    """Combinations of BAPO's rollout sources with GRPOTrainer arguments that cannot work, refused by name before
    anything is loaded (they used to fail at the first step, or silently replace the user's function)."""
    problems = []
    dataset = kwargs.get("train_dataset")
    if args.replay_enabled and (kwargs.get("tools") or kwargs.get("environment_factory")):
        problems.append("replay (`replay_buffer_size` > 0) stores token batches and cannot hold tool-calling or "
                        "environment rollouts (`tools` / `environment_factory`): switch one of them off.")
    if args.replay_enabled and dataset is not None and "image" in (getattr(dataset, "column_names", None) or []):
        problems.append("replay (`replay_buffer_size` > 0) does not support multimodal batches (the train_dataset "
                        "has an `image` column): switch replay off.")
    if args.partial_rollout_enabled and kwargs.get("rollout_func") is not None:
        problems.append("partial rollout (`partial_rollout_budget`) serves finished completions through TRL's "
                        "`rollout_func` hook and would replace yours: pass either `rollout_func` or "
                        "`partial_rollout_budget`, not both.")
    if args.partial_rollout_enabled and (kwargs.get("tools") or kwargs.get("environment_factory")):
        problems.append("partial rollout (`partial_rollout_budget`) grows single-turn completions and cannot continue "
                        "tool-calling or environment rollouts: switch one of them off.")
    if args.partial_rollout_enabled and _is_iterable_dataset(dataset):
        problems.append("partial rollout (`partial_rollout_budget`) tops up its pool by random access to the "
                        f"train_dataset, which a {type(dataset).__name__} does not allow: use a map-style Dataset.")
    if getattr(args, "async_generation", False):
        if kwargs.get("rollout_func") is not None:
            problems.append("async generation (`async_generation`) serves its completions through TRL's "
                            "`rollout_func` hook and would replace yours: pass one of them, not both.")
        if kwargs.get("tools") or kwargs.get("environment_factory"):
            problems.append("async generation (`async_generation`) makes single-turn requests and cannot run "
                            "tool-calling or environment rollouts (`tools` / `environment_factory`).")
        if _is_iterable_dataset(dataset):
            problems.append("async generation (`async_generation`) draws its prompts ahead by random access to the "
                            f"train_dataset, which a {type(dataset).__name__} does not allow: use a map-style Dataset.")
        if dataset is not None and "image" in (getattr(dataset, "column_names", None) or []):
            problems.append("async generation (`async_generation`) sends token prompts only; the train_dataset has "
                            "an `image` column.")
    if problems:
        raise ValueError("Invalid BAPOTrainer arguments:\n  - " + "\n  - ".join(problems))

