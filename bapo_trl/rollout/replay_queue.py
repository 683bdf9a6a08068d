"""A replay queue of whole GRPO groups, kept with the log-probs of the policy that sampled them.

Independent of the trainer: it stores and returns dicts of per-row tensors. What a group carries:
``prompt_ids``/``prompt_mask`` (left-padded), ``completion_ids``/``completion_mask`` (right-padded), the
``advantages`` computed at generation time, ``old_per_token_logps`` (the BEHAVIOR log-probs, so a replayed
token's ratio is current policy over the policy that produced it), ``policy_version`` (optimizer step at
sampling), and any other per-row tensor the trainer hands over (reference log-probs, vLLM IS ratios...).

Whole groups, because GRPO advantages are relative within a group. Groups with no advantage spread carry no
learning signal and are not stored. The queue lives on CPU, bounded by ``capacity`` groups; a group older than
``max_staleness`` optimizer steps is evicted and never returned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .settings import queue_settings_errors

#: Keys padded on the LEFT (prompts are left-aligned against the completion in TRL).
LEFT_PADDED = ("prompt_ids", "prompt_mask")


@dataclass
class ReplayStats:
    """Counters since the last ``pop_stats`` (for metrics) and totals (for checkpoints)."""

    pushed: int = 0
    evicted_age: int = 0
    evicted_capacity: int = 0
    sampled: int = 0
    totals: dict = field(default_factory=lambda: {"pushed": 0, "evicted": 0, "sampled": 0})


class ReplayQueue:
    """Bounded queue of GRPO groups on CPU.

    Args:
        capacity: maximum number of groups held; the oldest are evicted first when full.
        max_staleness: a group whose ``current_step - policy_version`` exceeds this is evicted.
        sampling: ``"uniform"`` (every held group equally likely), ``"recent"`` (the newest groups first) or
            ``"advantage"`` (probability proportional to the group's advantage range ``max A - min A``, so groups
            where completions differ most in quality are replayed more).
        seed: seed of the queue's own generator (saved in checkpoints, so a resumed run samples the same groups).
    """

    def __init__(self, capacity: int, max_staleness: int, sampling: str = "uniform", seed: int = 0):
        errors = queue_settings_errors(capacity, max_staleness, sampling, off_allowed=False)
        if errors:
            raise ValueError(" ".join(errors))
        self.capacity, self.max_staleness, self.sampling = capacity, max_staleness, sampling
        self.groups: list[dict[str, torch.Tensor]] = []
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = ReplayStats()

    def __len__(self) -> int:
        return len(self.groups)

    # -- writing --------------------------------------------------------------------------------------------

    def push(self, group: dict[str, torch.Tensor]) -> bool:
        """Store one group (rows of equal-length tensors). Returns False (not stored) if it has no signal."""
        advantages = group["advantages"]
        if advantages.numel() == 0 or float(advantages.max() - advantages.min()) == 0.0:
            return False
        self.groups.append({k: _compact(k, v.detach().to("cpu"), group) for k, v in group.items()})
        self.stats.pushed += 1
        self.stats.totals["pushed"] += 1
        while len(self.groups) > self.capacity:
            self.groups.pop(0)  # groups are appended in version order: the oldest is first
            self.stats.evicted_capacity += 1
            self.stats.totals["evicted"] += 1
        return True

    def evict_stale(self, current_step: int) -> int:
        """Drop every group older than ``max_staleness`` optimizer steps; returns how many."""
        keep = [g for g in self.groups if current_step - int(g["policy_version"][0]) <= self.max_staleness]
        evicted = len(self.groups) - len(keep)
        self.groups = keep
        self.stats.evicted_age += evicted
        self.stats.totals["evicted"] += evicted
        return evicted

    # -- reading --------------------------------------------------------------------------------------------

    def sample(self, num_groups: int, current_step: int, evict: bool = True) -> list[dict[str, torch.Tensor]]:
        """Up to ``num_groups`` distinct groups still within ``max_staleness`` at ``current_step`` (evicting stale
        ones first; ``evict=False``, for a step in the future: leaving them for the batches before it). Sampled
        groups stay in the queue and may be replayed again until they age out."""
        if evict:
            self.evict_stale(current_step)
        groups = self.groups if evict else self.valid_at(current_step)
        n = min(num_groups, len(groups))
        if n <= 0:
            return []
        if self.sampling == "recent":
            order = sorted(range(len(groups)), key=lambda i: -int(groups[i]["policy_version"][0]))
            # among equally recent groups, random order
            versions = torch.tensor([int(groups[i]["policy_version"][0]) for i in order])
            jitter = torch.rand(len(order), generator=self.generator)
            keys = sorted(range(len(order)), key=lambda j: (-int(versions[j]), float(jitter[j])))
            index = [order[j] for j in keys[:n]]
        else:
            if self.sampling == "uniform":
                weights = torch.ones(len(groups))
            else:
                weights = torch.tensor([float(g["advantages"].max() - g["advantages"].min()) for g in groups])
                weights = weights.clamp(min=1e-6)
            index = torch.multinomial(weights, n, replacement=False, generator=self.generator).tolist()
        self.stats.sampled += n
        self.stats.totals["sampled"] += n
        return [groups[i] for i in index]

    def valid_at(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The groups still within ``max_staleness`` at optimizer step ``step``."""
        return [g for g in self.groups if step - int(g["policy_version"][0]) <= self.max_staleness]

    def pop_stats(self) -> dict[str, float]:
        """Counters since the previous call, for logging."""
        s = self.stats
        out = {"pushed": s.pushed, "evicted": s.evicted_age + s.evicted_capacity, "evicted_age": s.evicted_age,
               "evicted_capacity": s.evicted_capacity, "sampled": s.sampled}
        s.pushed = s.evicted_age = s.evicted_capacity = s.sampled = 0
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "max_staleness": self.max_staleness,
            "sampling": self.sampling,
            "groups": self.groups,
            "generator": self.generator.get_state(),
            "totals": dict(self.stats.totals),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the groups, sampler state and totals. The CURRENT settings apply (a resumed run may change them on
        purpose); a change is warned about, naming the fields, and the stored groups are trimmed to the new capacity
        (oldest first) and re-checked for staleness at the next sample."""
        changed = [f"{field}: {state[key]!r} in the checkpoint -> {getattr(self, key)!r} now"
                   for key, field in (("capacity", "replay_buffer_size"), ("max_staleness", "replay_max_staleness"),
                                      ("sampling", "replay_sampling"))
                   if key in state and state[key] != getattr(self, key)]
        if changed:
            warnings.warn("Resuming the replay queue with changed settings (the current ones apply): "
                          + "; ".join(changed) + ".", UserWarning, stacklevel=2)
        self.groups = [dict(g) for g in state["groups"]][-self.capacity:]
        self.generator.set_state(state["generator"])
        self.stats = ReplayStats(totals=dict(state["totals"]))


def _compact(key: str, value: torch.Tensor, group: dict) -> torch.Tensor:
    """Drop padding shared by every row of the group, so stored groups cost what their tokens cost."""
    if value.dim() != 2:
        return value
    if key in LEFT_PADDED:
        keep = int(group["prompt_mask"].sum(1).max())
        return value[:, value.size(1) - keep :]
    if _is_completion_like(key, value, group):
        keep = int(group["completion_mask"].sum(1).max()) if group["completion_mask"].numel() else 0
        return value[:, : max(keep, 1)]  # keep at least one column so shapes stay (rows, >= 1)
    return value


def _is_completion_like(key: str, value: torch.Tensor, row: dict) -> bool:
    return key not in LEFT_PADDED and value.dim() >= 2 and value.size(1) == row["completion_ids"].size(1)


def pad_and_stack(parts: list[dict[str, torch.Tensor]], pad_values: dict[str, float]) -> dict[str, torch.Tensor]:
    """Concatenate groups / batches row-wise: prompts padded on the left, completion-aligned tensors (same width as
    ``completion_ids``) on the right, with ``pad_values[key]`` (default 0; padding is masked out anyway)."""
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        left = key in LEFT_PADDED
        if left or _is_completion_like(key, values[0], parts[0]):
            width = max(v.size(1) for v in values)
            padded = []
            for v in values:
                extra = width - v.size(1)
                if extra:
                    filler = v.new_full((v.size(0), extra, *v.shape[2:]), pad_values.get(key, 0))
                    v = torch.cat([filler, v] if left else [v, filler], dim=1)
                padded.append(v)
            values = padded
        out[key] = torch.cat(values, dim=0)
    return out


def split_groups(batch: dict[str, torch.Tensor], group_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a batch of per-row tensors into consecutive groups of ``group_size`` rows (TRL keeps a prompt's
    completions consecutive)."""
    rows = next(iter(batch.values())).size(0)
    if rows % group_size:
        raise ValueError(f"a batch of {rows} rows does not split into whole groups of {group_size}.")
    return [{k: v[i : i + group_size] for k, v in batch.items()} for i in range(0, rows, group_size)]


def groups_to_replace(
    has_signal: list[bool], count: int, prefer_no_signal: bool, generator: torch.Generator
) -> list[int]:
    """Which fresh groups give up their place to replayed ones: ``count`` of them, groups without learning
    signal first when ``prefer_no_signal``, otherwise a random choice."""
    order = torch.randperm(len(has_signal), generator=generator).tolist()
    if prefer_no_signal:
        order = [i for i in order if not has_signal[i]] + [i for i in order if has_signal[i]]
    return sorted(order[:count])
