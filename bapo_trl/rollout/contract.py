"""The rollout contract: what a rollout source is, and the narrow port through which it reaches TRL.

A *rollout source* makes the training batches of one trainer process. It never sees the trainer: it is built with a
:class:`TrainerPort`, the only code between a source and ``GRPOTrainer``'s internals (the trainer's ``trl_port.py``),
and asked for one batch at a time with TRL's own scoring function. What every source guarantees, whatever it does
inside:

* the batch is TRL's (what ``GRPOTrainer._generate_and_score_completions`` returns) with one group of
  ``num_generations`` completions per ``num_generations`` rows of ``inputs`` (the dataloader's rows for this
  generation batch);
* ``policy_version`` (``(B,)``, long): the optimizer step of the OLDEST policy that sampled a token of the completion,
  and, where the tokens of one completion come from several policies, ``token_policy_version`` (``(B, T)``) per token;
* ``old_per_token_logps``, when present, are the log-probs of the policy that sampled each token (the behaviour
  policy), so BAPO's ratio sees the real staleness;
* its state round-trips through ``state_dict()`` / ``load_state_dict()`` (one file per process, named by
  ``state_name``; ``None``: nothing to save), ``close()`` ends whatever runs in the background, and ``paused()``
  holds background generation while TRL generates for evaluation (a no-op where nothing runs in the background);
* what else it can do is declared, not probed: ``plans_ahead``, ``metrics_by_age``, ``behaviour_from_sampler``.

A source reads the run's configuration through ``port.settings`` (:class:`~.settings.SourceSettings`: the rollout
fields and the few facts of TRL's it needs), never the config itself.

A new source is one file with a class that takes ``(port)`` and one line
``register_source("name", "module:Class")`` (or the class itself); ``BAPOConfig(rollout_source="name")`` selects it
(:mod:`bapo_trl.rollout.registry`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

import torch

from ..core.metrics import SAMPLER
from .settings import SourceSettings

#: TRL's ``_generate_and_score_completions`` (bound): dataset rows -> TRL's batch.
ScoreFn = Callable[[list[dict]], dict[str, Any]]


@dataclass
class ReadyCompletions:
    """Completions generated outside TRL's generate call, for TRL to score: one entry per completion, in the order of
    the dataset rows."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logps: list[list[float]]  # the sampler's own log-prob of each token (TRL's IS correction compares them)
    behaviour_logps: list[list[float]]  # the log-prob of the policy that produced each token (BAPO's ratio)


@runtime_checkable
class RolloutSource(Protocol):
    """Makes this process's training batches (see the module doc for what each batch guarantees), and declares what
    else it can do: the trainer and the sources that wrap it read these, they probe for nothing."""

    state_name: str | None
    #: It generates batches ahead and takes a planner: ``plan_with(planner)`` and ``next_index``
    #: (:class:`~.async_generation.AsyncGeneration`); replay then chooses the groups standing in for generation when a
    #: batch is queued instead of when it is handed over.
    plans_ahead: bool
    #: Its tokens differ in age within a batch: the trainer logs the search's share by token age too.
    metrics_by_age: bool
    #: Its behaviour log-probs are a sampler's own (a backend's or the vLLM server's), not the trainer's computation:
    #: a batch of the current policy's version still has ratios away from 1 (the sampler's gap), and the search acts
    #: on it. False: a batch whose tokens are all of the current version is exactly on-policy (TRL's window).
    behaviour_from_sampler: bool

    def next_batch(self, inputs: list[dict], score: ScoreFn) -> dict[str, Any]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...

    def paused(self) -> ContextManager[None]: ...


class PortFacts(Protocol):
    """What the run is: the source's settings, the policy's version, the data, this process among the others."""

    @property
    def settings(self) -> SourceSettings: ...  # the run's configuration, as far as the sources read it

    @property
    def num_generations(self) -> int: ...

    @property
    def global_step(self) -> int: ...  # optimizer steps taken = the version of the current policy

    @property
    def train_dataset(self) -> Any: ...

    @property
    def shuffle_dataset(self) -> bool: ...  # whether TRL's sampler shuffles the train set

    @property
    def max_completion_length(self) -> int: ...  # the generation backend's cap per completion

    @property
    def device(self) -> torch.device: ...

    @property
    def process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def pad_token_id(self) -> int: ...

    def stop_token_ids(self) -> list[int]: ...


class PortGeneration(Protocol):
    """TRL's generation (transformers or vLLM) and the run's generation backend's
    (:mod:`bapo_trl.generation.contract`), from any thread."""

    def tokenize_prompts(self, prompts: list) -> list[list[int]]: ...

    def continue_completions(self, prefixes: list[list[int]], max_new_tokens: int
                             ) -> tuple[list[list[int]], list[list[float]] | None]: ...

    @property
    def samples_through_backend(self) -> bool: ...  # a backend of the user's own: every source samples through it

    def sample(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int | None = None
               ) -> dict[str, list]: ...

    # one completion per row, the backend brought to the current weights first
    def sample_rows(self, prompts: list) -> tuple[list[list[int]], dict[str, list]]: ...

    def requests_answered(self) -> int: ...  # generate requests answered so far (a batch's progress, any thread)


class PortWeights(Protocol):
    """Bringing the generation backend to the current policy: at once, or gathered now and sent later."""

    def push_weights(self) -> None: ...

    def gather_weights(self) -> Any: ...  # None: only the synchronous push_weights exists

    def send_weights(self, state: Any) -> None: ...

    @property
    def weights_step(self) -> int | None: ...  # the step whose weights the generation backend holds

    def mark_weights_current(self) -> None: ...


class PortScoring(Protocol):
    """The policy's log-probs outside the loss, and TRL's scoring of completions generated elsewhere."""

    def policy_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     batch_size: int | None = None, inputs: dict[str, Any] | None = None) -> torch.Tensor: ...

    def score_completions(self, score: ScoreFn, rows: list[dict], ready: ReadyCompletions) -> dict[str, Any]: ...


class PortProcesses(Protocol):
    """The other trainer processes (collectives: every process calls them at the same point) and TRL's metrics."""

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def max_over_processes(self, value: torch.Tensor) -> torch.Tensor: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def log_metrics(self, values: dict[str, float], mode: str = "train") -> None: ...


class TrainerPort(PortFacts, PortGeneration, PortWeights, PortScoring, PortProcesses, Protocol):
    """What a rollout source may ask of the trainer, and nothing more, in five parts. Implemented over
    ``GRPOTrainer`` by :class:`bapo_trl.trainer.trl_port.TRLPort`; a test can implement it (or the parts its source
    uses) over anything."""


class NothingInBackground:
    """Defaults for a source with no state of its own and nothing running between batches."""

    state_name: str | None = None
    plans_ahead = False
    metrics_by_age = False
    behaviour_from_sampler = True  # unknown: the search acts on every batch that carries old log-probs

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def paused(self) -> ContextManager[None]:
        return contextlib.nullcontext()


def parts(source: RolloutSource) -> list[RolloutSource]:
    """The source and every source it wraps (``inner``), outermost first."""
    chain = [source]
    while getattr(chain[-1], "inner", None) is not None:
        chain.append(chain[-1].inner)
    return chain


def stamp_policy_version(output: dict[str, Any], step: int) -> dict[str, Any]:
    """Mark every completion of a batch as sampled by the policy of optimizer step ``step``."""
    ids = output["completion_ids"]
    output["policy_version"] = torch.full((ids.size(0),), step, dtype=torch.long, device=ids.device)
    return output


def stamp_token_versions(output: dict[str, Any], versions: list[list[int]], fill: int) -> dict[str, Any]:
    """Per-token policy versions (``fill`` on padding) and each completion's oldest, on a scored batch."""
    ids = output["completion_ids"]
    per_token = right_pad(versions, ids.size(1), fill, torch.long, ids.device)
    output["token_policy_version"] = per_token
    output["policy_version"] = per_token.min(dim=1).values
    return output


def continuation_logps(port: TrainerPort, prefixes: list[list[int]], segments: list[list[int]]
                       ) -> list[list[float]]:
    """The current policy's log-probs of each ``segments[i]`` after ``prefixes[i]`` (token ids), as the trainer
    computes them: ONE forward however many prefixes this rank has (ranks differ; ZeRO-3 needs equal forward counts),
    also when every segment is empty (then on a stand-in token)."""
    if not any(segments):
        empty = [[] for _ in segments]
        continuation_logps(port, [prefixes[0][:-1] or prefixes[0]], [prefixes[0][-1:]])
        return empty
    width = max(len(s) for s in segments)
    total = max(len(p) for p in prefixes) + width
    # prefixes left-padded, segments right-padded: the segment tokens then sit in the last `width` columns
    ids = torch.full((len(prefixes), total), port.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(prefixes), total), dtype=torch.long)
    start = total - width
    for i, (p, s) in enumerate(zip(prefixes, segments)):
        ids[i, start - len(p) : start + len(s)] = torch.tensor(p + s)
        attention[i, start - len(p) : start + len(s)] = 1
    logps = port.policy_logps(ids.to(port.device), attention.to(port.device), width, batch_size=len(prefixes))
    return [logps[i, : len(s)].tolist() for i, s in enumerate(segments)]


def log_sampler_gap(port: TrainerPort, policy_logps: list[list[float]], sampler_logps: list[list[float]]) -> None:
    """Log TRL's ``sampling/sampling_logp_difference/{mean,max}`` for completions a backend of the user's own sampled:
    ``|log pi_policy - log pi_sampler|`` per token, over every process (collective: every process calls it). TRL logs
    them only for its vLLM; with another sampler the gap is otherwise invisible, though BAPO's ratio carries it."""
    gaps = [abs(a - b) for pol, smp in zip(policy_logps, sampler_logps) for a, b in zip(pol, smp)
            if math.isfinite(a) and math.isfinite(b)]
    total = port.sum_over_processes(torch.tensor([sum(gaps), len(gaps)], dtype=torch.float64, device=port.device))
    largest = port.max_over_processes(torch.tensor(max(gaps, default=0.0), dtype=torch.float64, device=port.device))
    mean = float(total[0] / total[1]) if float(total[1]) > 0 else 0.0
    port.log_metrics(dict(zip(SAMPLER, (mean, float(largest)))))


def right_pad(rows: list[list], width: int, fill, dtype: torch.dtype, device) -> torch.Tensor:
    """Per-completion lists as one ``(len(rows), width)`` tensor, each row cut or filled with ``fill`` to ``width``."""
    return torch.tensor([(list(r) + [fill] * width)[:width] for r in rows], dtype=dtype, device=device)


def is_iterable_dataset(dataset) -> bool:
    """A dataset without random access (sources that draw prompts ahead of the dataloader need random access)."""
    import datasets

    return isinstance(dataset, (torch.utils.data.IterableDataset, datasets.IterableDataset))


#: The dataset columns TRL reads images from (``GRPOTrainer._generate_and_score_completions``: ``images``, else
#: ``image``).
IMAGE_COLUMNS = ("image", "images")


def image_column(dataset) -> str | None:
    """The ``dataset``'s image column (None without one): a source that generates or stores token batches without
    the images (replay, partial rollout, async generation) refuses such a dataset by name instead of training a
    vision-language model on text-only log-probs. A 🤗 ``IterableDataset`` whose features are unknown (built from a
    generator) is read from its first row, so the refusal comes at construction, not at the first batch."""
    columns = getattr(dataset, "column_names", None)
    if columns is None and dataset is not None:
        import datasets

        if isinstance(dataset, datasets.IterableDataset):  # unknown features: its first row says (re-iterable)
            first = next(iter(dataset.take(1)), None)
            columns = list(first) if isinstance(first, dict) else []
    return next((name for name in IMAGE_COLUMNS if name in (columns or [])), None)
