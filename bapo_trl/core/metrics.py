"""The per-update metrics, as pure functions: local sums -> (one collective, in the trainer) -> named values.

Why this shape: every metric of an update must agree across processes, and a collective per metric would cost more
than the search. So each function here returns the LOCAL sums of one micro-batch packed in one float64 vector; the
trainer reduces it once over processes and turns it into values under the stable names registered below (the plot
command, the notebooks, the run summary and the docs rely on them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .clipping import SearchPath
from .entropy_clip import METRICS as ENTROPY_CLIP
from .entropy_clip import NUM_SUMS as ENTROPY_CLIP_SUMS
from .entropy_clip import entropy_clip_metrics, entropy_clip_sums, without_gradient
from .loss_types import CLIPPED_SURROGATE, LossType

Reduce = Callable[[torch.Tensor], torch.Tensor]

#: Logged at every update.
SEARCH = (
    "bapo/clip_low",
    "bapo/clip_high",
    "bapo/positive_contribution",
    "bapo/positive_contribution_before",
    "bapo/search_steps",
    "bapo/search_active",
    "bapo/target_met",
    "bapo/search_exhausted",
    "bapo/positive_loss_share",
    "bapo/negative_loss_share",
    "bapo/positive_gradient_share",
    "bapo/clip_fraction_low",
    "bapo/clip_fraction_high",
    "bapo/clip_fraction_positive",
    "bapo/clip_fraction_negative",
    "bapo/positive_token_fraction",
    "bapo/nonfinite_tokens",
    "bapo/staleness_mean",
    "bapo/staleness_max",
    "bapo/positive_contribution_target",
)
#: Logged at every update: the search's and the Entropy-Clip Rule's (0.1's ``bapo_trl.trainer.BAPO_METRICS``).
UPDATE = SEARCH + ENTROPY_CLIP
#: Logged when the replay queue is on (the first seven once per generation batch, the rest per update).
REPLAY = (
    "replay/size",
    "replay/fraction",
    "replay/token_fraction",
    "replay/evicted",
    "replay/pushed",
    "replay/generation_saved",
    "replay/staleness_mean",
    "replay/staleness_max",
    "bapo/positive_loss_share/fresh",
    "bapo/positive_loss_share/replayed",
    "bapo/clip_fraction/fresh",
    "bapo/clip_fraction/replayed",
)
#: Logged once per generation batch when partial rollout is on.
PARTIAL = (
    "partial/carried",
    "partial/resumes_mean",
    "partial/segments_per_completion",
    "partial/token_staleness_mean",
    "partial/token_staleness_max",
)
#: Staleness buckets (optimizer steps since the token was sampled) of the per-age split.
AGE_BUCKETS = ("0", "1", "2", "3+")
#: Logged when async generation is on: the first nine once per generation batch (main process), the rest per update.
ASYNC = (
    "async/wait_seconds",
    "async/generate_seconds",
    "async/push_seconds",
    "async/load_seconds",
    "async/overlap_fraction",
    "async/queue_depth",
    "async/staleness_mean",
    "async/staleness_max",
    "bapo/weight_sync_lag",
    *(f"bapo/{what}/age_{age}" for age in AGE_BUCKETS
      for what in ("positive_loss_share", "clip_fraction", "token_fraction")),
)
#: Logged per update with a soft-gate loss (sapo, vespo): the gate parameters installed in TRL's loss.
GATES = (
    "bapo/sapo_temperature_pos",
    "bapo/sapo_temperature_neg",
    "bapo/vespo_k_pos",
    "bapo/vespo_lambda_pos",
    "bapo/vespo_k_neg",
    "bapo/vespo_lambda_neg",
)
#: Logged when a training generation batch is scored: totals since the start of the run (a resume included) of the
#: batches scored, and of those in which no completion got a reward (every reward function returned None).
REWARDS = (
    "bapo/generation_batches",
    "bapo/generation_batches_without_reward",
)
#: Logged once per generation batch where a generation backend of the user's own samples synchronously: TRL's names
#: for the sampler's log-prob gap (TRL logs them for its vLLM only).
SAMPLER = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)
#: Logged with the training logs while a vLLM server is pushed weights through the disk: per push, averaged over the
#: pushes since the last log (``trainer/vllm_backend.py``).
WEIGHT_SYNC = (
    "weight_sync/pushed_bytes",
    "weight_sync/seconds",
)
#: Every metric name the method logs, by group (a research candidate in ``bapo_trl/experimental`` lists its own).
REGISTRY = {"search": SEARCH, "entropy_clip": ENTROPY_CLIP, "replay": REPLAY, "partial": PARTIAL, "async": ASYNC,
            "gates": GATES, "rewards": REWARDS, "sampler": SAMPLER, "weight_sync": WEIGHT_SYNC}

#: valid, positive, negative, low-clipped, high-clipped (by the window), window-sensitive, positive and negative tokens
#: without gradient, staleness sum, non-finite
_COUNTS = 10


def with_trl_clip(loss: LossType, path: SearchPath) -> LossType:
    """The loss type's row whose clip flags are every token TRL's loss gives no gradient: with TRL's two-sided clip
    (``path.delta``, the dual clip; clipped losses only, as in TRL) a negative token above ``delta`` too
    (:func:`~bapo_trl.core.entropy_clip.without_gradient`). Without ``delta``: ``loss`` itself."""
    if loss.kind != "clip" or path.delta is None:
        return loss
    return dataclasses.replace(loss, clipped=without_gradient(loss.clipped, path.delta))


def token_staleness(inputs: dict, step: int, like: torch.Tensor) -> torch.Tensor | None:
    """Optimizer steps since each token was sampled (per token with partial rollout, else per completion), as
    float64 shaped like ``like``; None when the batch carries no policy versions."""
    version = inputs.get("token_policy_version", inputs.get("policy_version"))
    if version is None:
        return None
    staleness = (step - version).to(torch.float64)
    return (staleness[:, None] if staleness.dim() == 1 else staleness).expand_as(like)


def search_sums(result, path: SearchPath, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                logps: torch.Tensor, entropies: torch.Tensor | None, staleness: torch.Tensor | None,
                nonfinite_inputs: torch.Tensor,
                loss: LossType = CLIPPED_SURROGATE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, local largest staleness)`` of one micro-batch for :func:`search_values`; ``advantages`` as the search
    saw them (per row or per token); ``loss`` says which tokens the chosen window clips. The low/high counts are the
    window's (what TRL's ``clip_ratio/*`` count); the counts by sign and the Entropy-Clip sums take every token TRL's
    loss gives no gradient, negatives above TRL's two-sided clip ``path.delta`` included (:func:`with_trl_clip`)."""
    device = ratio.device
    advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(ratio)
    valid = (mask != 0) & torch.isfinite(ratio) & torch.isfinite(advantages)
    positive, negative = valid & (advantages > 0), valid & (advantages < 0)
    c_low, c_high = result.clip_low.to(ratio.dtype), result.clip_high.to(ratio.dtype)
    low_clipped, high_clipped = loss.clipped(ratio, advantages, c_low, c_high)
    low_clipped, high_clipped = low_clipped & valid, high_clipped & valid
    no_gradient = with_trl_clip(loss, path).clipped  # the window's flags, and the negatives above delta
    dropped = torch.stack(no_gradient(ratio, advantages, c_low, c_high)).any(0) & valid
    # Tokens whose loss some window on the path would change (clipped surrogate: a positive above the smallest
    # c_high, a negative below the largest c_low). None (every ratio 1, or all inside both): the search cannot act.
    sensitive = loss.sensitive(ratio, positive, negative, path)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    stale_sum = zero if staleness is None else (staleness * valid).sum()
    stale_max = zero if staleness is None or not staleness.numel() else torch.where(valid, staleness, 0.0).max()
    counts = torch.stack([valid.sum(), positive.sum(), negative.sum(), low_clipped.sum(), high_clipped.sum(),
                          sensitive.sum(), (dropped & positive).sum(), (dropped & negative).sum()]).to(torch.float64)
    entropy = zero.expand(2) if entropies is None else torch.stack(
        [torch.where(valid, entropies.detach().double(), 0.0).sum(), valid.sum().double()])
    sums = torch.cat([counts, torch.stack([stale_sum, nonfinite_inputs.to(device=device, dtype=torch.float64)]),
                      entropy_clip_sums(logps, ratio, advantages, mask, result.clip_low, result.clip_high,
                                        no_gradient).to(device),
                      entropy])
    return sums, stale_max


def search_values(sums: list[float], result: dict[str, float], path: SearchPath, stale_max: float,
                  target: float) -> tuple[dict[str, float], tuple[float, float]]:
    """Named values from REDUCED :func:`search_sums` and the search result (``SearchResult.as_floats()``), plus the
    policy entropy summed over the real tokens and their count (both 0 when unknown). An update on which no window of
    the path changes the loss is reported with the start window and 0 steps (``bapo/search_active`` 0), not the
    path's end."""
    n, n_pos, n_neg, n_low, n_high, n_sensitive, n_pos_clipped, n_neg_clipped, stale_sum, nonfinite_inputs = (
        sums[:_COUNTS])
    entropy_sum, entropy_tokens = sums[_COUNTS + ENTROPY_CLIP_SUMS :]
    r = dict(result)
    active = n_sensitive > 0
    if not active:
        r.update(clip_low=path.clip_low[0], clip_high=path.clip_high[0], steps=0,
                 positive_contribution=r["positive_contribution_before"])
    values = {
        "bapo/clip_low": r["clip_low"],
        "bapo/clip_high": r["clip_high"],
        "bapo/positive_contribution": r["positive_contribution"],
        "bapo/positive_contribution_before": r["positive_contribution_before"],
        "bapo/search_steps": r["steps"],
        "bapo/search_active": float(active),
        "bapo/target_met": r["target_met"],
        "bapo/search_exhausted": float(r["steps"] == len(path) - 1 and not r["target_met"]),
        "bapo/positive_loss_share": r["value_share"],
        "bapo/negative_loss_share": 1.0 - r["value_share"],
        "bapo/positive_gradient_share": r["gradient_share"],
        "bapo/clip_fraction_low": n_low / max(n, 1.0),
        "bapo/clip_fraction_high": n_high / max(n, 1.0),
        "bapo/clip_fraction_positive": n_pos_clipped / n_pos if n_pos else float("nan"),
        "bapo/clip_fraction_negative": n_neg_clipped / n_neg if n_neg else float("nan"),
        "bapo/positive_token_fraction": n_pos / max(n, 1.0),
        "bapo/nonfinite_tokens": r["num_nonfinite"] + nonfinite_inputs,
        "bapo/staleness_mean": stale_sum / max(n, 1.0),
        "bapo/staleness_max": stale_max,
        "bapo/positive_contribution_target": target,
        **entropy_clip_metrics(sums[_COUNTS : _COUNTS + ENTROPY_CLIP_SUMS]),
    }
    return values, (entropy_sum, entropy_tokens)


def _share_sums(result, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, parts: list[torch.Tensor],
                loss: LossType = CLIPPED_SURROGATE) -> tuple[list[torch.Tensor], torch.Tensor]:
    """For every token subset in ``parts``: positive and negative sums of the loss type's share at the chosen window
    (the value share for the clipped surrogate), clipped tokens, tokens (all over the valid tokens); and the valid
    mask."""
    advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(ratio)
    valid = (mask != 0) & torch.isfinite(ratio) & torch.isfinite(advantages)
    c_low, c_high = result.clip_low.to(ratio.dtype).double(), result.clip_high.to(ratio.dtype).double()
    r = torch.where(valid, ratio, 1.0).double()
    a = torch.where(valid, advantages, 0.0).double()
    pos, neg = loss.contributions(r, a, c_low, c_high, valid=valid)  # the loss type's share terms at the window
    low, high = loss.clipped(r, a, c_low, c_high)
    clipped = low | high
    sums = []
    for part in parts:
        part = part & valid
        sums += [pos[part].sum(), neg[part].sum(), clipped[part].sum().double(), part.sum().double()]
    return sums, valid


def _share_values(p: float, n: float, clipped: float, count: float) -> tuple[float, float]:
    """(positive value share, clip fraction) of one subset's reduced sums; NaN where it has no tokens."""
    return (p / (p + n) if p + n > 0 else float("nan")), (clipped / count if count else float("nan"))


def origin_sums(result, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, replayed: torch.Tensor,
                staleness: torch.Tensor, loss: LossType = CLIPPED_SURROGATE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, local largest replay staleness)``: value share and clip counts of fresh and of replayed tokens."""
    replayed = replayed[:, None].expand_as(ratio)
    sums, valid = _share_sums(result, ratio, advantages, mask, [~replayed, replayed], loss)
    rep = replayed & valid
    sums.append((staleness * rep).sum())
    stale_max = torch.where(rep, staleness, 0.0).max() if rep.numel() else torch.zeros((), dtype=torch.float64)
    return torch.stack(sums), stale_max.to(ratio.device)


def origin_values(totals: list[float], stale_max: float) -> dict[str, float]:
    """Named values from REDUCED :func:`origin_sums`."""
    values = {}
    for name, sums in (("fresh", totals[0:4]), ("replayed", totals[4:8])):
        values[f"bapo/positive_loss_share/{name}"], values[f"bapo/clip_fraction/{name}"] = _share_values(*sums)
    n_rep = totals[7]
    values["replay/staleness_mean"] = totals[8] / n_rep if n_rep else float("nan")
    values["replay/staleness_max"] = stale_max if n_rep else float("nan")
    return values


def age_sums(result, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             staleness: torch.Tensor, loss: LossType = CLIPPED_SURROGATE) -> torch.Tensor:
    """Value share and clip counts of the tokens of each staleness bucket (:data:`AGE_BUCKETS`; ``staleness`` per
    token, shaped like ``ratio``)."""
    parts = [staleness == age for age in range(len(AGE_BUCKETS) - 1)] + [staleness >= len(AGE_BUCKETS) - 1]
    sums, _ = _share_sums(result, ratio, advantages, mask, parts, loss)
    return torch.stack(sums)


def age_values(totals: list[float]) -> dict[str, float]:
    """Named values from REDUCED :func:`age_sums`: per bucket, positive share, clip fraction and share of tokens."""
    values, tokens = {}, sum(totals[3::4])
    for i, age in enumerate(AGE_BUCKETS):
        p, n, clipped, count = totals[4 * i : 4 * i + 4]
        share, clip = _share_values(p, n, clipped, count)
        values[f"bapo/positive_loss_share/age_{age}"] = share
        values[f"bapo/clip_fraction/age_{age}"] = clip
        values[f"bapo/token_fraction/age_{age}"] = count / tokens if tokens else float("nan")
    return values


def partial_sums(completions, carried: int, step: int) -> tuple[list[float], float]:
    """``(sums, local largest token age)`` of the completions a partial-rollout batch scores (ages at ``step``)."""
    ages = [step - v for c in completions for v in c.versions]
    sums = [float(carried), float(sum(c.resumes for c in completions)), float(sum(c.segments for c in completions)),
            float(len(completions)), float(sum(ages)), float(len(ages))]
    return sums, float(max(ages, default=0))


def partial_values(sums: list[float], oldest: float) -> dict[str, float]:
    """The ``partial/*`` values from (reduced) :func:`partial_sums`."""
    carried, resumes, segments, count, age_sum, tokens = sums
    return {
        "partial/carried": carried,
        "partial/resumes_mean": resumes / max(count, 1.0),
        "partial/segments_per_completion": segments / max(count, 1.0),
        "partial/token_staleness_mean": age_sum / max(tokens, 1.0),
        "partial/token_staleness_max": oldest,
    }


def replay_sums(queue_size: int, replayed: torch.Tensor, mask: torch.Tensor, counts: dict[str, float],
                not_generated_rows: int) -> torch.Tensor:
    """Local sums of one mixed batch for :func:`replay_values`: queue size, replayed and all rows, replayed and all
    tokens, evicted and pushed groups (``counts`` of ``ReplayQueue.pop_stats``), rows not generated."""
    return torch.tensor(
        [queue_size, float(replayed.sum()), float(replayed.numel()), float((mask * replayed[:, None]).sum()),
         float(mask.sum()), counts["evicted"], counts["pushed"], float(not_generated_rows)],
        dtype=torch.float64, device=mask.device)


def replay_values(sums: list[float]) -> dict[str, float]:
    """The per-batch ``replay/*`` values from REDUCED :func:`replay_sums`."""
    size, n_rep, n_rows, tok_rep, tok_all, evicted, pushed, not_generated = sums
    return {
        "replay/size": size,
        "replay/fraction": n_rep / max(n_rows, 1.0),
        "replay/token_fraction": tok_rep / max(tok_all, 1.0),
        "replay/evicted": evicted,
        "replay/pushed": pushed,
        "replay/generation_saved": not_generated / max(n_rows, 1.0),  # share of the batch not generated
    }


def async_values(versions: list[list[int]], step: int, generate_seconds: float, waited: float,
                 push_seconds: float, queue_depth: int, load_seconds: float = 0.0,
                 weight_sync_lag: int | None = None) -> dict[str, float]:
    """The per-batch ``async/*`` values of one global batch (per-token policy versions) handed at ``step``;
    ``load_seconds``: the generation thread's time loading pushed weights since the previous hand-over;
    ``weight_sync_lag``: optimizer steps the server's weights were behind the trainer when the batch's request
    started (``bapo/weight_sync_lag``, NaN when not known: a batch restored from a checkpoint of an older release).
    The data's staleness (``async/staleness_*``) counts from the trainer's step when the batch TRAINS; the lag, at
    generation: a push that is slow or spaced (``weight_sync_steps``) shows in the lag, a deep queue in neither."""
    ages = [step - v for row in versions for v in row] or [0]
    return {
        "async/wait_seconds": waited,
        "async/generate_seconds": generate_seconds,
        "async/push_seconds": push_seconds,
        "async/load_seconds": load_seconds,
        # share of this batch's generation hidden behind training (1: the trainer never waited for it)
        "async/overlap_fraction": (min(max(1.0 - waited / generate_seconds, 0.0), 1.0) if generate_seconds
                                   else 1.0),
        "async/queue_depth": float(queue_depth),
        "async/staleness_mean": sum(ages) / len(ages),
        "async/staleness_max": float(max(ages)),
        "bapo/weight_sync_lag": float("nan") if weight_sync_lag is None else float(weight_sync_lag),
    }


def gate_values(loss: LossType, clip_low: float, clip_high: float) -> dict[str, float]:
    """The config fields a loss type sets in TRL's loss at the reported window (a soft gate's shape), as
    ``bapo/<field>``; none for the clip and cap rows (``bapo/clip_high`` is the cap)."""
    return {f"bapo/{name[len('args.'):]}": float(value) for name, value in loss.to_trl(clip_low, clip_high).items()
            if name.startswith("args.")}


@dataclasses.dataclass(kw_only=True)
class SearchRecord:
    """What one loss call's search saw and chose, as the metrics need it (built by keyword; not TRL's micro-batch,
    which is ``inputs``): ``result`` and ``path`` the search's,
    ``loss`` the loss type's row, ``ratio``/``advantages``/``mask`` what it balanced, ``inputs`` TRL's micro-batch,
    ``logps``/``entropies`` the policy forward's, ``step`` the optimizer step, ``nonfinite_inputs`` the tokens dropped
    before the forward, ``target`` rho0, the two reductions over processes, and ``by_age`` (report the share by token
    age)."""

    result: object
    path: SearchPath
    loss: LossType
    ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    inputs: dict
    logps: torch.Tensor
    entropies: torch.Tensor | None
    step: int
    nonfinite_inputs: torch.Tensor
    target: float
    sum_over_processes: Reduce
    max_over_processes: Reduce
    by_age: bool


def update_values(batch: SearchRecord) -> tuple[dict[str, float], tuple[float, float]]:
    """Every value a micro-batch logs (search, Entropy-Clip; fresh vs replayed tokens when the batch holds replayed
    rows; the share by token age when ``by_age``), with the fewest collectives: one sum and one max per group.
    Returns the values and ``(entropy sum, tokens)`` over all processes (0, 0 when the entropy is unknown). Clipped
    tokens are those TRL's loss gives no gradient, the dual clip's negatives above ``delta`` included (except in
    ``bapo/clip_fraction_low/high``, the window's, as TRL's ``clip_ratio/*``)."""
    b = batch
    staleness = token_staleness(b.inputs, b.step, b.ratio)
    sums, stale_max = search_sums(b.result, b.path, b.ratio, b.advantages, b.mask, b.logps, b.entropies, staleness,
                                  b.nonfinite_inputs, b.loss)
    sums, stale_max = b.sum_over_processes(sums).tolist(), b.max_over_processes(stale_max)
    values, entropy = search_values(sums, b.result.as_floats(), b.path, float(stale_max), b.target)
    values.update(gate_values(b.loss, values["bapo/clip_low"], values["bapo/clip_high"]))
    values.update(origin_and_age_values(b, staleness))
    return values, entropy


def origin_and_age_values(batch: SearchRecord, staleness: torch.Tensor | None) -> dict[str, float]:
    """The share of fresh vs replayed tokens (when the batch holds replayed rows) and by token age (when
    ``batch.by_age``), at the window ``batch.result`` holds (one sum and one max per group)."""
    b, values = batch, {}
    if "replayed" in b.inputs:  # fresh vs replayed tokens
        replay_staleness = (b.step - b.inputs["policy_version"]).double()[:, None].expand_as(b.ratio)
        totals, rep_max = origin_sums(b.result, b.ratio, b.advantages, b.mask, b.inputs["replayed"], replay_staleness,
                                      with_trl_clip(b.loss, b.path))
        totals, rep_max = b.sum_over_processes(totals), b.max_over_processes(rep_max)
        values.update(origin_values(totals.tolist(), float(rep_max)))
    if b.by_age and staleness is not None:
        values.update(age_values(b.sum_over_processes(age_sums(b.result, b.ratio, b.advantages, b.mask, staleness,
                                                               with_trl_clip(b.loss, b.path))).tolist()))
    return values


def is_active(entry: dict) -> bool:
    """Whether the search could act in this logged update (some window on its path changes the loss); logs
    written before ``bapo/search_active`` existed count as active."""
    return (entry.get("bapo/search_active") or 0.0) > 0 if "bapo/search_active" in entry else "bapo/clip_low" in entry
