"""The loss types BAPO balances, one row each: the ratios the loss acts on, how the chosen window reaches TRL's loss,
how the positive share of that loss is measured, which tokens count how much, and which tokens the window clips.

Why a table: a loss type touches places that must agree (the attributes TRL's ``_compute_loss`` reads, the share the
search balances, the clip flags of the metrics and the Entropy-Clip diagnostics). Adding a loss type is a row here
plus its tests; :data:`SUPPORTED_LOSS_TYPES` (what ``BAPOConfig`` accepts) is derived from the table. The math of
every row, and why it is the faithful reading of "balanced" for that loss, is in ``docs/loss_types.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from . import loss_checks
from .clipping import cap_path, cap_sums, grid_sums, search_path
from .gates import negative_scale, positive_scale, sapo_sums, sapo_weight, vespo_log_weights, vespo_sums, vespo_weight

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


# -- ratios: what the loss's clip (or gate) acts on, broadcast to the tokens ------------------------------------------

def token_log_ratio(logps: torch.Tensor, inputs: dict) -> torch.Tensor:
    """``(B, T)`` detached ``log pi_theta - log pi_old`` per token; zeros when TRL skipped the old log-probs (the data
    is on-policy, every ratio exactly 1)."""
    old = inputs.get("old_per_token_logps")
    return logps.detach() - old if old is not None else torch.zeros_like(logps)


def trl_ratios(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, inputs: dict) -> torch.Tensor:
    """``(B, T)`` ratios as TRL's ``_compute_loss`` forms ``coef_1``: per token ``exp(log r)``, or per sequence
    (GSPO) ``exp(sum_t m log r / max(sum_t m, 1))`` over the loss mask, broadcast to the sequence's tokens."""
    if level == "token":
        return torch.exp(log_ratio)
    mean = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp(mean).expand_as(log_ratio)


def vespo_ratios(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, inputs: dict) -> torch.Tensor:
    """``(B, T)``: VESPO's sequence weight ``w`` (the product of the token ratios and of the vLLM IS weights, as TRL
    forms it, whatever ``importance_sampling_level`` says) on every token of the sequence."""
    log_w = vespo_log_weights(log_ratio, mask, inputs.get("importance_sampling_ratio"))
    return torch.exp(log_w).expand_as(log_ratio)


# -- aggregation: how much each token counts in TRL's loss ------------------------------------------------------------

def summed_tokens(mask: torch.Tensor) -> None:
    """Losses that sum tokens over the micro-batch and divide by one constant (dapo, bnpo, dr_grpo, cispo, vespo,
    luspo): every token counts once, so no weight (at sequence level a sequence counts its length)."""
    return None


def sequence_mean(mask: torch.Tensor) -> torch.Tensor:
    """Losses that average each sequence over its tokens, then the sequences (grpo, sapo): a token counts
    ``1 / L_i`` (``L_i`` its sequence's tokens in TRL's loss mask), so a sequence counts once."""
    return 1.0 / mask.sum(-1, keepdim=True).clamp(min=1.0)


# -- the clip flags (metrics and Entropy-Clip diagnostics) ------------------------------------------------------------

def surrogate_clipped(ratio: torch.Tensor, advantages: torch.Tensor,
                      c_low, c_high) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``: tokens the surrogate ``min(r A, clip(r, c_low, c_high) A)`` takes the gradient from: a
    negative-advantage token below ``c_low``, a positive one above ``c_high``."""
    return (advantages < 0) & (ratio < c_low), (advantages > 0) & (ratio > c_high)


def cap_clipped(ratio, advantages, c_low, c_high):
    """CISPO: ``(none, positives whose weight is capped)``, what TRL's ``cispo_clip_ratio`` counts. A capped token
    keeps a gradient (its weight falls from ``r`` to ``c``); negatives above ``c`` are capped too, and not counted."""
    return torch.zeros_like(ratio, dtype=torch.bool), (advantages > 0) & (ratio > c_high)


def none_clipped(ratio, advantages, c_low, c_high):
    """Soft gates clip no token: every token keeps a gradient, scaled by its gate."""
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return none, none


# -- the tokens some candidate of the path would treat differently (``bapo/search_active``) ---------------------------

def surrogate_sensitive(ratio, positive, negative, path):
    """A positive above the smallest ``c_high`` or a negative below the largest ``c_low``."""
    return (positive & (ratio > path.clip_high[0])) | (negative & (ratio < max(path.clip_low)))


def cap_sensitive(ratio, positive, negative, path):
    """Any token above the smallest cap."""
    return (positive | negative) & (ratio > path.clip_high[0])


def gate_sensitive(ratio, positive, negative, path):
    """Any token whose ratio is not exactly 1 (a gate's sharpness changes its weight)."""
    return (positive | negative) & (ratio != 1.0)


# -- per-token contributions at the chosen window (the share's terms, for the fresh/replayed/age metrics) -------------

def surrogate_contributions(r, a, c_low, c_high, valid=None):
    """Value share terms: ``min(r, c_high) A`` for ``A > 0``, ``max(r, c_low) |A|`` for ``A < 0``."""
    return (torch.where(a > 0, torch.minimum(r, c_high) * a, 0.0),
            torch.where(a < 0, torch.maximum(r, c_low) * -a, 0.0))


def cap_contributions(r, a, c_low, c_high, valid=None):
    """``min(r, c) |A|`` by sign."""
    capped = torch.minimum(r, c_high) * a.abs()
    return torch.where(a > 0, capped, 0.0), torch.where(a < 0, capped, 0.0)


def sapo_contributions(r, a, c_low, c_high, *, sapo_temperature_pos, sapo_temperature_neg, ratio_upper_start,
                       ratio_lower_start, **_):
    tau_pos = positive_scale(c_high, ratio_upper_start) * sapo_temperature_pos
    tau_neg = negative_scale(c_low, ratio_lower_start) * sapo_temperature_neg
    return (torch.where(a > 0, sapo_weight(r, tau_pos) * a, 0.0),
            torch.where(a < 0, sapo_weight(r, tau_neg) * -a, 0.0))


def vespo_contributions(r, a, c_low, c_high, *, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg,
                        ratio_upper_start, ratio_lower_start, **_):
    s_pos, s_neg = positive_scale(c_high, ratio_upper_start), negative_scale(c_low, ratio_lower_start)
    log_w = torch.log(r.clamp_min(1e-300))
    return (torch.where(a > 0, vespo_weight(log_w, s_pos * vespo_k_pos, s_pos * vespo_lambda_pos) * a, 0.0),
            torch.where(a < 0, vespo_weight(log_w, s_neg * vespo_k_neg, s_neg * vespo_lambda_neg) * -a, 0.0))


# -- how a chosen window reaches TRL's loss ---------------------------------------------------------------------------

def surrogate_window(c_low, c_high) -> dict:
    """TRL clips with ``clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)``: the window ``[c_low, c_high]`` is
    ``epsilon_low = 1 - c_low``, ``epsilon_high = c_high - 1``."""
    return {"epsilon_low": 1.0 - c_low, "epsilon_high": c_high - 1.0}


def cap_window(c_low, c_high) -> dict:
    """TRL's CISPO caps with ``clamp(coef_1, max=epsilon_high)``: ``epsilon_high`` IS the cap ``c`` (not ``c - 1``)."""
    return {"epsilon_high": c_high}


def sapo_window(c_low, c_high, *, sapo_temperature_pos, sapo_temperature_neg, ratio_upper_start, ratio_lower_start,
                **_) -> dict:
    """TRL's SAPO reads ``args.sapo_temperature_pos/neg``: the start temperatures times each sign's sharpness."""
    return {"args.sapo_temperature_pos": positive_scale(c_high, ratio_upper_start) * sapo_temperature_pos,
            "args.sapo_temperature_neg": negative_scale(c_low, ratio_lower_start) * sapo_temperature_neg}


def vespo_window(c_low, c_high, *, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, ratio_upper_start,
                 ratio_lower_start, **_) -> dict:
    """TRL's VESPO reads ``args.vespo_{k,lambda}_{pos,neg}``: each sign's shape times its sharpness."""
    s_pos, s_neg = positive_scale(c_high, ratio_upper_start), negative_scale(c_low, ratio_lower_start)
    return {"args.vespo_k_pos": s_pos * vespo_k_pos, "args.vespo_lambda_pos": s_pos * vespo_lambda_pos,
            "args.vespo_k_neg": s_neg * vespo_k_neg, "args.vespo_lambda_neg": s_neg * vespo_lambda_neg}


@dataclass(frozen=True)
class LossType:
    """How BAPO acts on one of TRL's loss types.

    Attributes:
        objective: the per-token objective, in the spec's notation (for docs and error messages).
        kind: ``"clip"`` (a window ``[c_low, c_high]`` on the ratio; TRL's ``delta`` applies), ``"cap"`` (an upper cap
            on the detached ratio, no lower bound) or ``"gate"`` (a soft gate whose sharpness the window sets).
        to_trl: ``(c_low, c_high)`` (0-dim tensors, or floats) -> what TRL's loss reads: a ``GRPOTrainer`` attribute,
            or ``"args.<field>"`` for a config field (set for the loss call only, then restored).
        grid_sums: the positive/negative sums of the share for every point of the search path
            (:func:`bapo_trl.core.clipping.grid_sums` signature), reduced over processes and searched by
            :func:`bapo_trl.core.clipping.choose_bounds`.
        clipped: ``(ratio, advantages, c_low, c_high)`` -> ``(low, high)`` boolean masks of the clipped tokens.
        path: the search settings -> the candidates (:func:`bapo_trl.core.clipping.search_path`, or
            :func:`bapo_trl.core.clipping.cap_path` for a loss without a lower bound).
        ratios: ``(log_ratio, loss mask, importance_sampling_level, inputs)`` -> the ``(B, T)`` ratios the loss's clip
            or gate acts on (per token, or the sequence's ratio on each of its tokens).
        aggregation: the loss mask -> each token's weight in TRL's loss (``(B, 1)``), or None when every token counts
            once; it multiplies the advantages the search sees, so the share counts tokens as the loss does.
        sensitive: ``(ratio, positive, negative, path)`` -> tokens some candidate of the path treats differently.
        contributions: ``(r, a, c_low, c_high, valid=)`` -> per-token ``(pos, neg)`` terms of the share at one window
            (``valid``: the ``(B, T)`` tokens in the loss, for a row whose terms are per sequence).
        reads: the config fields the row's functions take as keywords (a gate's starting shape; with them the
            path's starts ``ratio_upper_start``, ``ratio_lower_start``): :meth:`bind` gives them the run's values.
        is_weight_in_ratio: TRL already folds its vLLM importance-sampling weights into the ratio (VESPO), so the
            search must not multiply the advantages by them again.
        uses_is_weights: the loss multiplies by TRL's vLLM importance-sampling weights at all (a research
            candidate's may not, so its share does not either).
        config_errors, config_warnings: ``(args, name)`` -> what this loss refuses, or warns of, in a config
            (:mod:`.loss_checks`): the config switches on no loss type.
    """

    objective: str
    kind: str
    to_trl: Callable
    grid_sums: Callable
    clipped: Callable
    path: Callable = search_path
    ratios: Callable = trl_ratios
    aggregation: Callable = summed_tokens
    sensitive: Callable = surrogate_sensitive
    contributions: Callable = surrogate_contributions
    reads: tuple[str, ...] = ()
    is_weight_in_ratio: bool = False
    uses_is_weights: bool = True
    config_errors: Callable = loss_checks.clipped_errors
    config_warnings: Callable = loss_checks.clipped_warnings

    @property
    def takes_delta(self) -> bool:
        """TRL applies its two-sided clip ``delta`` to this loss (the clipped losses)."""
        return self.kind == "clip"

    def bind(self, args) -> LossType:
        """This row with the run's values of :attr:`reads` given to its functions (a row without any: itself)."""
        if not self.reads:
            return self
        values = {name: getattr(args, name) for name in self.reads}
        values |= {name: args.search_path[name] for name in ("ratio_upper_start", "ratio_lower_start")}
        return dataclasses.replace(self, to_trl=partial(self.to_trl, **values),
                                   grid_sums=partial(self.grid_sums, **values),
                                   contributions=partial(self.contributions, **values))


CLIPPED_SURROGATE = LossType(
    objective="min(r A, clip(r, c_low, c_high) A)",
    kind="clip",
    to_trl=surrogate_window,
    grid_sums=grid_sums,
    clipped=surrogate_clipped,
)
CAPPED_WEIGHT = LossType(
    objective="sg(min(r, c)) A log pi",
    kind="cap",
    to_trl=cap_window,
    grid_sums=cap_sums,
    clipped=cap_clipped,
    path=cap_path,
    sensitive=cap_sensitive,
    contributions=cap_contributions,
    config_errors=loss_checks.capped_errors,
    config_warnings=loss_checks.capped_warnings,
)
SAPO_GATE = LossType(
    objective="sigmoid(tau (r - 1)) 4 / tau A, tau = tau_sign s_sign",
    kind="gate",
    to_trl=sapo_window,
    grid_sums=sapo_sums,
    clipped=none_clipped,
    aggregation=sequence_mean,
    sensitive=gate_sensitive,
    contributions=sapo_contributions,
    reads=("sapo_temperature_pos", "sapo_temperature_neg"),
    config_errors=loss_checks.sapo_errors,
    config_warnings=loss_checks.gate_warnings,
)
VESPO_GATE = LossType(
    objective="sg(phi(w) ** s_sign) A log pi, phi(w) = exp(lambda + k log w - lambda w)",
    kind="gate",
    to_trl=vespo_window,
    grid_sums=vespo_sums,
    clipped=none_clipped,
    ratios=vespo_ratios,
    sensitive=gate_sensitive,
    contributions=vespo_contributions,
    reads=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    is_weight_in_ratio=True,
    config_errors=loss_checks.vespo_errors,
    config_warnings=loss_checks.vespo_warnings,
)

#: TRL ``loss_type`` -> how BAPO balances it. dapo, bnpo, dr_grpo and luspo differ only in TRL's normaliser (one
#: constant per micro-batch); grpo averages each sequence first, so its tokens count ``1 / L``.
LOSS_TYPES: dict[str, LossType] = {
    "dapo": CLIPPED_SURROGATE,
    "bnpo": CLIPPED_SURROGATE,
    "grpo": dataclasses.replace(CLIPPED_SURROGATE, aggregation=sequence_mean),
    "dr_grpo": CLIPPED_SURROGATE,
    "luspo": CLIPPED_SURROGATE,
    "cispo": CAPPED_WEIGHT,
    "sapo": SAPO_GATE,
    "vespo": VESPO_GATE,
}
SUPPORTED_LOSS_TYPES = tuple(LOSS_TYPES)
