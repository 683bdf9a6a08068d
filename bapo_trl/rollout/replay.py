"""Replay as a rollout source wrapping any other: past groups, with the behaviour log-probs of the policy that sampled
them, mixed into each fresh batch (the paper's "sample replay" off-policy setting).

By default ``replay_ratio`` of each batch's fresh groups give up their place to stored ones (groups without reward
spread first, with ``replay_fill_zero_std_groups``). With ``replay_saves_generation`` the inner source is asked for
fewer groups (fewer rows of ``inputs``) and the stored ones are added, so generation itself shrinks. A source that
generates ahead (async generation) is told, when it queues a batch, how many groups of it to leave out: the stored
groups standing in for them are chosen then (among those still fresh enough at the batch's last update) and kept,
with the plan, in the checkpoint. Staleness is counted at the LAST update that trains on a batch, so no group trains
past ``replay_max_staleness``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.metrics import replay_sums, replay_values
from ..core.numerics import loss_mask
from .contract import RolloutSource, ScoreFn, TrainerPort, image_column
from .replay_queue import ReplayQueue, groups_to_replace, pad_and_stack, split_groups


def source_argument_errors(args, kwargs: dict) -> list[str]:
    """GRPOTrainer arguments replay cannot serve (checked before anything is loaded)."""
    problems = []
    if kwargs.get("tools") or kwargs.get("environment_factory"):
        problems.append("replay (`replay_buffer_size` > 0) stores token batches and cannot hold tool-calling or "
                        "environment rollouts (`tools` / `environment_factory`): switch one of them off.")
    column = image_column(kwargs.get("train_dataset"))
    if column is not None:
        problems.append("replay (`replay_buffer_size` > 0) stores token batches without their images: it cannot "
                        f"replay the train_dataset's `{column}` column. Switch replay off for a vision-language "
                        "dataset.")
    return problems


class ReplaySource:
    """Replay around ``inner`` for one trainer process; ``queue`` is its checkpointed state."""

    state_name = "replay_queue"
    argument_errors = staticmethod(source_argument_errors)
    plans_ahead = False  # nothing plans replay's batches: it plans those of a source that generates ahead

    def __init__(self, port: TrainerPort, inner: RolloutSource):
        settings = port.settings
        self.port, self.inner = port, inner
        self.queue = ReplayQueue(settings.replay_buffer_size, settings.replay_max_staleness, settings.replay_sampling,
                                 seed=settings.seed + 7919 * port.process_index)
        self.reserved: dict[int, list[dict]] = {}  # batch index -> stored groups chosen to stand in for generation
        self.chooses_ahead = settings.replay_saves_generation and inner.plans_ahead
        if self.chooses_ahead:
            inner.plan_with(self._plan)

    @property
    def metrics_by_age(self) -> bool:
        return self.inner.metrics_by_age

    @property
    def behaviour_from_sampler(self) -> bool:  # replayed groups keep the log-probs their source recorded
        return self.inner.behaviour_from_sampler

    def state_dict(self) -> dict:
        return {**self.queue.state_dict(), "reserved": self.reserved}

    def load_state_dict(self, state: dict) -> None:
        self.queue.load_state_dict(state)
        self.reserved = dict(state.get("reserved", {}))  # absent in checkpoints written before it was saved

    def close(self) -> None:
        self.inner.close()

    def paused(self):
        return self.inner.paused()

    def next_batch(self, inputs: list[dict], score: ScoreFn) -> dict[str, Any]:
        if self.chooses_ahead:
            stand_in = self.reserved.pop(self.inner.next_index, [])
            output = self.inner.next_batch(inputs[: len(inputs) - len(stand_in) * self.port.num_generations], score)
            return self.mix(output, appended=len(stand_in), stand_in=stand_in)
        saved = self.groups_saved(inputs)
        output = self.inner.next_batch(inputs[: len(inputs) - saved * self.port.num_generations], score)
        return self.mix(output, appended=saved)

    def _plan(self, index: int, ahead: int) -> int:
        """For a source generating ahead: how many groups of batch ``index`` (``ahead`` batches after the one being
        handed) to leave out, the replay share when every process holds enough groups still within
        ``replay_max_staleness`` at that batch's last update (else 0); the stand-ins are chosen now."""
        port, settings = self.port, self.port.settings
        wanted = settings.replayed_groups_per_batch
        last_update = port.global_step + (ahead + 1) * settings.updates_per_generation - 1
        mine = torch.tensor(-float(len(self.queue.valid_at(last_update))), device=port.device)
        if -port.max_over_processes(mine) < wanted:
            return 0
        self.reserved[index] = [{k: v.clone() for k, v in g.items()}
                                for g in self.queue.sample(wanted, current_step=last_update, evict=False)]
        return wanted

    def groups_saved(self, inputs: list[dict]) -> int:
        """With ``replay_saves_generation``: how many groups of this batch to take from the queue instead of
        generating them (the replay share), or 0 (full generation) while any process's queue holds fewer
        replayable groups; decided on all processes together, so every rank generates the same amount."""
        port, settings = self.port, self.port.settings
        if not settings.replay_saves_generation:
            return 0
        wanted = settings.replayed_groups_per_batch
        self.queue.evict_stale(port.global_step + settings.updates_per_generation - 1)
        fewest = -port.max_over_processes(torch.tensor(-float(len(self.queue)), device=port.device))
        return wanted if fewest >= wanted else 0

    def mix(self, output: dict[str, Any], appended: int = 0, stand_in: list[dict] | None = None) -> dict[str, Any]:
        """Store the fresh groups and mix in replayed ones: ``appended`` groups added to a batch generated short by
        that many (replay that saves generation; ``stand_in``: the groups chosen when the batch was planned), else
        ``replay_ratio`` of the fresh groups replaced."""
        port, queue, settings = self.port, self.queue, self.port.settings
        rows = output["completion_ids"].size(0)
        per_row = {k: v for k, v in output.items() if torch.is_tensor(v) and v.dim() >= 1 and v.size(0) == rows}
        other = {k: v for k, v in output.items() if k not in per_row}
        unsupported = [k for k, v in other.items() if not (torch.is_tensor(v) and v.dim() == 0)]
        if unsupported:
            raise ValueError(f"Replay does not support batches with {unsupported} (multimodal or tool inputs).")
        if "old_per_token_logps" not in per_row:  # on-policy batch: TRL skipped them, the queue needs them
            per_row["old_per_token_logps"] = self._behaviour_logps(per_row)
        device = per_row["completion_ids"].device
        group_size = port.num_generations
        fresh = split_groups(per_row, group_size)
        has_signal = [bool(g["advantages"].max() > g["advantages"].min()) for g in fresh]

        wanted = settings.replayed_groups_per_batch  # round(replay_ratio x groups), checked against 0 in the config
        if settings.replay_fill_zero_std_groups:
            wanted = max(wanted, has_signal.count(False))
        last_update = port.global_step + settings.updates_per_generation - 1
        # every mix first drops the groups too old to replay at this batch's last update (also where the replayed
        # groups were chosen ahead: the queue's size and evictions then count replayable groups, step by step)
        queue.evict_stale(last_update)
        if stand_in:
            replayed, replaced = stand_in, set()
        elif appended:  # the queue holds them (checked on every process before generating)
            replayed, replaced = queue.sample(appended, current_step=last_update), set()
        else:
            replayed = queue.sample(min(wanted, len(fresh)), current_step=last_update)
            replaced = set(groups_to_replace(has_signal, len(replayed), settings.replay_fill_zero_std_groups,
                                             queue.generator))
        for group in fresh:
            queue.push(group)
        kept = [dict(g, replayed=torch.zeros(group_size, dtype=torch.bool, device=device))
                for i, g in enumerate(fresh) if i not in replaced]
        loaded = [dict({k: v.to(device) for k, v in g.items()},
                       replayed=torch.ones(group_size, dtype=torch.bool, device=device)) for g in replayed]
        mixed = pad_and_stack(kept + loaded, {"prompt_ids": port.pad_token_id, "completion_ids": port.pad_token_id})
        mask = loss_mask(mixed)
        other["num_items_in_batch"] = port.sum_over_processes(mask.sum())
        sums = replay_sums(len(queue), mixed["replayed"], mask, queue.pop_stats(), appended * group_size)
        port.log_metrics(replay_values(port.sum_over_processes(sums).tolist()))
        return {**mixed, **other}  # a per-row tensor first: TRL sizes the batch by the first value

    def _behaviour_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return self.port.policy_logps(input_ids, attention_mask, batch["completion_ids"].size(1), inputs=batch)
