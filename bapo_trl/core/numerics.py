"""Keep a micro-batch's numbers finite before TRL's loss reads them.

TRL multiplies the per-token loss by the mask, and ``NaN * 0`` is NaN: one NaN behaviour log-prob on a padded
position (vLLM returns NaN for tokens it could not score) poisons the step. Two passes edit the batch in place:

* :func:`mask_nonfinite_inputs`, BEFORE ``GRPOTrainer.compute_loss`` (TRL binds its loss mask at the start of
  ``_compute_loss``, so a later edit would not reach the loss): real tokens with a non-finite input
  (behaviour or reference log-prob, IS weight, advantage: :data:`DROPPING_KEYS`) are counted and, when
  ``mask_nonfinite`` is on, dropped from the LOSS only, through ``tool_mask`` (TRL multiplies it into the loss mask,
  never into the attention mask): the later tokens of the completion are still scored with the dropped token in
  their context, as their behaviour and reference log-probs were. The sampler's own log-prob
  (``sampling_per_token_logps``; vLLM gives NaN for a token it could not score) drops a token only where it IS the
  behaviour log-prob (async generation, its partial rollout and in-flight chunks: the NaN is then in
  ``old_per_token_logps`` too). On the synchronous paths the behaviour log-prob is the trainer's own and TRL trains
  such a token, with IS weight 1 (its correction turns the NaN difference into 0): so does bapo_trl;
* :func:`sanitize_after_forward`, after the policy forward and before TRL reads the inputs: non-finite values left
  anywhere (padding, real tokens when masking is off, a sampler's log-prob that TRL trains with) are replaced
  (log-probs by the current log-prob, so the ratio is 1 and TRL's off-policy mask reads no divergence there, as its own
  ``nan_to_num`` does; importance weights by 1), and the log-ratio to the behaviour policy is clamped to
  ``[-max_log_ratio, max_log_ratio]`` (the official code clamps at 20), so the ratio's ``exp`` cannot overflow for
  tokens the other policy all but ruled out. That ratio is the one all of TRL's loss reads, so beyond 20 nats the clamp
  also reaches GSPO's sequence ratio, the weight ``r |A|`` of a negative token without a dual clip, the bias-corrected
  KL's ratio factor and, without sampler log-probs, the off-policy mask's divergence; the sampler's own log-probs
  (which only that mask reads, as a difference) are not clamped. The reference log-ratio, which only TRL's KL term
  reads, is left as TRL computes it, but for a reference log-prob more than :func:`reference_log_ratio_limit` above the
  policy's (44 nats in float32 and bfloat16, 10 in float16), where ``exp`` overflows or nearly does, or more than
  :data:`REFERENCE_FLOOR` (10,000 nats) below it: with ``beta > 0`` the KL value and gradient are TRL's for every other
  token (the official code's 20 changed TRL's KL term from 20 nats on either side).

Both passes work on the micro-batch :meth:`BAPOTrainer.compute_loss` hands to TRL, a shallow copy of the batch it was
given: TRL feeds the same buffered batch to every one of its ``num_iterations``, and each loss call sanitises against
its own forward.

Non-finite CURRENT log-probs (a model that blew up) cannot be repaired or dropped (they are known only after the
forward, when TRL's mask is bound); they are counted in the metric.
"""

from __future__ import annotations

import math

import torch

#: The per-token log-probs TRL's loss may read: non-finite values left in them are filled after the forward.
LOGP_KEYS = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
#: The per-token inputs whose non-finite value on a real token drops it from the loss (with the row's advantage):
#: the behaviour and reference log-probs and TRL's IS weight, not the sampler's log-prob (see the module doc).
DROPPING_KEYS = ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens TRL's loss trains on: the completion mask, times the tool mask of tool-calling rollouts."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def _real(inputs: dict) -> torch.Tensor:
    return loss_mask(inputs) != 0


def _nonfinite_inputs(inputs: dict, shape: torch.Size) -> torch.Tensor:
    """Per token: an input that drops it (:data:`DROPPING_KEYS`, or the row's advantage) is NaN or inf."""
    advantages = inputs["advantages"]
    bad = ~torch.isfinite(advantages)
    bad = (bad[:, None] if advantages.dim() == 1 else bad).expand(shape).clone()
    for key in DROPPING_KEYS:
        value = inputs.get(key)
        if value is not None and value.shape == shape:
            bad |= ~torch.isfinite(value)
    return bad


def mask_nonfinite_inputs(inputs: dict, mask_nonfinite: bool = True) -> torch.Tensor:
    """Before the loss: count real tokens with a non-finite input and (``mask_nonfinite``) drop them from it, not from
    the attention (``completion_mask`` is left as it is)."""
    mask = inputs["completion_mask"]
    real_bad = _nonfinite_inputs(inputs, mask.shape) & _real(inputs)
    if mask_nonfinite and bool(real_bad.any()):
        keep = inputs.get("tool_mask", torch.ones_like(mask))
        inputs["tool_mask"] = torch.where(real_bad, torch.zeros_like(keep), keep)
        advantages = inputs["advantages"]
        inputs["advantages"] = torch.where(torch.isfinite(advantages), advantages, torch.zeros_like(advantages))
    return real_bad.sum()


#: The most nats a reference log-prob is left below the policy's: TRL's KL term grows like ``logp - ref`` there, times
#: the ratio (up to ``exp(max_log_ratio)``) with its default ``use_bias_correction_kl``; a value this far below is
#: garbage (``-1e30`` for a token never scored), which that product would turn into inf.
REFERENCE_FLOOR = 1e4


def reference_log_ratio_limit(dtype: torch.dtype) -> float:
    """The largest ``ref - logp`` left as it is (below, TRL's KL term ``exp(ref - logp) - (ref - logp) - 1`` never
    overflows): where the dtype holds ``exp`` of it squared, half the log of its largest number (44.4 in float32 and
    bfloat16), so the term and its products in the backward pass stay finite; else a nat below where ``exp``
    overflows (10.1 in float16, where TRL's own term is finite up to 11.1)."""
    top = math.log(torch.finfo(dtype).max)
    return min(top - 1.0, max(0.5 * top, 20.0))


def sanitize_after_forward(inputs: dict, per_token_logps: torch.Tensor, max_log_ratio: float = 20.0) -> torch.Tensor:
    """After the policy forward: fill what is left non-finite and clamp log-ratios (see module doc); returns the
    number of real tokens whose CURRENT log-prob is non-finite (and whose inputs were finite: counted once)."""
    current = per_token_logps.detach()
    inputs_bad = _nonfinite_inputs(inputs, current.shape)
    for key in LOGP_KEYS + ("importance_sampling_ratio",):
        value = inputs.get(key)
        if value is None or value.shape != current.shape:
            continue
        filler = current if key in LOGP_KEYS else torch.ones_like(value)
        value = torch.where(torch.isfinite(value), value, filler)
        if key == "ref_per_token_logps":  # TRL's KL term as it is, but where it would overflow
            above = reference_log_ratio_limit(current.dtype)
            value = torch.clamp(value, current - REFERENCE_FLOOR, current + above)
        elif key == "old_per_token_logps":  # the ratio's exp(logp - old), bounded at max_log_ratio
            value = torch.clamp(value, current - max_log_ratio, current + max_log_ratio)
        # the sampler's own log-probs are left as they are: only TRL's off-policy mask reads them, as a difference
        inputs[key] = value
    advantages = inputs["advantages"]
    if not bool(torch.isfinite(advantages).all()):  # only where masking is off: rows that are padding or counted
        inputs["advantages"] = torch.where(torch.isfinite(advantages), advantages, torch.zeros_like(advantages))
    return (~torch.isfinite(current) & ~inputs_bad & _real(inputs)).sum()


def sanitize_micro_batch(inputs: dict, per_token_logps: torch.Tensor, mask_nonfinite: bool = True,
                         max_log_ratio: float = 20.0) -> torch.Tensor:
    """Both passes at once (for a batch whose loss mask is not bound yet); returns the real non-finite tokens."""
    return mask_nonfinite_inputs(inputs, mask_nonfinite) + sanitize_after_forward(inputs, per_token_logps,
                                                                                  max_log_ratio)
