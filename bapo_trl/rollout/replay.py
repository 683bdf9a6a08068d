"""Replay as a rollout source: past groups, with the behaviour log-probs of the policy that sampled them, mixed
into each fresh batch (the paper's "sample replay" off-policy setting).

By default ``replay_ratio`` of each batch's fresh groups give up their place to stored ones (groups without reward
spread first, with ``replay_fill_zero_std_groups``). With ``replay_saves_generation`` the batch is generated short
by that many groups and the stored ones are added, so generation itself shrinks. Staleness is counted at the LAST
update that trains on a batch, so no group trains past ``replay_max_staleness``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..numerics import loss_mask
from .queue import ReplayQueue, groups_to_replace, pad_and_stack, split_groups

if TYPE_CHECKING:
    from ..trainer import BAPOTrainer


class ReplayMixer:
    """The replay source of one trainer process; ``queue`` is its checkpointed state."""

    def __init__(self, trainer: BAPOTrainer):
        args = trainer.args
        self.trainer = trainer
        self.queue = ReplayQueue(args.replay_buffer_size, args.replay_max_staleness, args.replay_sampling,
                                 seed=args.seed + 7919 * trainer.accelerator.process_index)

    def state_dict(self) -> dict:
        return self.queue.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.queue.load_state_dict(state)

    def groups_saved(self, inputs: list[dict]) -> int:
        """With ``replay_saves_generation``: how many groups of this batch to take from the queue instead of
        generating them (the replay share), or 0 (full generation) while any process's queue holds fewer
        replayable groups; decided on all processes together, so every rank generates the same amount."""
        trainer, args = self.trainer, self.trainer.args
        if not args.replay_saves_generation:
            return 0
        wanted = args.replayed_groups_per_batch
        self.queue.evict_stale(trainer.state.global_step + args.updates_per_generation - 1)
        mine = torch.tensor(-float(len(self.queue)), device=trainer.accelerator.device)
        fewest = -trainer._max_over_processes(mine)
        return wanted if fewest >= wanted else 0

    def mix(self, output: dict[str, Any], appended: int = 0) -> dict[str, Any]:
        """Store the fresh groups and mix in replayed ones: ``appended`` groups added to a batch generated short by
        that many (replay that saves generation), else ``replay_ratio`` of the fresh groups replaced."""
        trainer, queue, args = self.trainer, self.queue, self.trainer.args
        rows = output["completion_ids"].size(0)
        per_row = {k: v for k, v in output.items() if torch.is_tensor(v) and v.dim() >= 1 and v.size(0) == rows}
        other = {k: v for k, v in output.items() if k not in per_row}
        unsupported = [k for k, v in other.items() if not (torch.is_tensor(v) and v.dim() == 0)]
        if unsupported:
            raise ValueError(f"Replay does not support batches with {unsupported} (multimodal or tool inputs).")
        if "old_per_token_logps" not in per_row:  # on-policy batch: TRL skipped them, the queue needs them
            per_row["old_per_token_logps"] = self._behavior_logps(per_row)
        device = per_row["completion_ids"].device
        group_size = trainer.num_generations
        fresh = split_groups(per_row, group_size)
        has_signal = [bool(g["advantages"].max() > g["advantages"].min()) for g in fresh]

        wanted = args.replayed_groups_per_batch  # round(replay_ratio x groups), checked against 0 in the config
        if args.replay_fill_zero_std_groups:
            wanted = max(wanted, has_signal.count(False))
        last_update = trainer.state.global_step + args.updates_per_generation - 1
        if appended:  # the queue holds them (checked on every process before generating)
            replayed, replaced = queue.sample(appended, current_step=last_update), set()
        else:
            replayed = queue.sample(min(wanted, len(fresh)), current_step=last_update)
            replaced = set(groups_to_replace(has_signal, len(replayed), args.replay_fill_zero_std_groups,
                                             queue.generator))
        for group in fresh:
            queue.push(group)
        kept = [dict(g, replayed=torch.zeros(group_size, dtype=torch.bool, device=device))
                for i, g in enumerate(fresh) if i not in replaced]
        loaded = [dict({k: v.to(device) for k, v in g.items()},
                       replayed=torch.ones(group_size, dtype=torch.bool, device=device)) for g in replayed]
        pad_id = trainer._tokenizer.pad_token_id  # TRL's tokenizer (also inside a processor)
        mixed = pad_and_stack(kept + loaded, {"prompt_ids": pad_id, "completion_ids": pad_id})
        mask = loss_mask(mixed)
        other["num_items_in_batch"] = trainer.accelerator.gather(mask.sum()).sum()
        self._log(mixed, mask, appended)
        return {**mixed, **other}  # a per-row tensor first: TRL sizes the batch by the first value

    def _behavior_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return self.trainer._policy_logps(input_ids, attention_mask, batch["completion_ids"].size(1))

    def _log(self, mixed: dict[str, torch.Tensor], mask: torch.Tensor, appended: int) -> None:
        trainer = self.trainer
        counts = self.queue.pop_stats()
        replayed = mixed["replayed"]
        local = torch.tensor(
            [len(self.queue), float(replayed.sum()), float(replayed.numel()),
             float((mask * replayed[:, None]).sum()), float(mask.sum()), counts["evicted"], counts["pushed"],
             float(appended * trainer.num_generations)],
            dtype=torch.float64, device=mask.device,
        )
        size, n_rep, n_rows, tok_rep, tok_all, evicted, pushed, not_generated = (
            trainer._sum_over_processes(local).tolist())
        metrics = trainer._metrics["train"]
        metrics["replay/size"].append(size)
        metrics["replay/fraction"].append(n_rep / max(n_rows, 1.0))
        metrics["replay/token_fraction"].append(tok_rep / max(tok_all, 1.0))
        metrics["replay/evicted"].append(evicted)
        metrics["replay/pushed"].append(pushed)
        metrics["replay/generation_saved"].append(not_generated / max(n_rows, 1.0))  # share not generated
