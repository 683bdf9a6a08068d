"""Soft gates (TRL's ``sapo`` and ``vespo`` losses) on BAPO's search path, as pure tensor functions.

SAPO and VESPO have no clipping window: each token's gradient is scaled by a smooth weight of its importance ratio,
whose sharpness is set per advantage sign (SAPO's temperatures ``tau``, VESPO's gamma shape ``(k, lambda)``). BAPO
balances them with the same fixed path as the clipped surrogate (Algorithm 1): each candidate window
``(c_low, c_high)`` of :func:`bapo_trl.core.clipping.search_path` is read as a SHARPNESS of each sign's gate,
relative to the gate the user configured (which is the path's start):

* ``s_pos(c_high) = (a+ - 1) / (c_high - 1)``: widening the upper half-width ``c_high - 1`` by a factor ``f`` widens
  the positive gate by the same factor (``s_pos = 1 / f``; 1 at the start, ``0.1`` at the default ``c_high = 3``);
* ``s_neg(c_low) = (1 - a-) / (1 - c_low)``: shrinking the lower half-width ``1 - c_low`` by ``f`` sharpens the
  negative gate by ``f`` (``s_neg = f``; 1 at the start, 4 at the default ``c_low = 0.9``).

SAPO: ``tau_sign = s_sign * sapo_temperature_sign`` (the gate ``sigmoid(tau (r - 1)) 4 / tau`` narrows as ``tau``
grows). VESPO: ``(k, lambda)_sign = s_sign * (vespo_k_sign, vespo_lambda_sign)``, i.e. the gamma weight is raised to
the power ``s``: ``phi_s(w) = phi(w) ** s`` keeps ``phi(1) = 1`` and its peak ``k / lambda``, flattens toward 1 as
``s -> 0`` (no reshaping of that sign) and sharpens for ``s > 1``.

The share (the same for ``positive_contribution_mode`` "value" and "gradient": every token keeps a gradient, so the
only faithful measure is the weight that gradient carries; a gate's VALUE carries a ``tau``-dependent constant):

* SAPO: ``d/d theta [sigmoid(tau (r - 1)) 4 / tau A] = g_tau(r) r A grad log pi`` with
  ``g_tau(r) = 4 sigmoid(x) (1 - sigmoid(x))``, ``x = tau (r - 1)``: each token weighs ``g_tau(r) r |A|``;
* VESPO: the loss is ``-sg(phi(w)) A log pi``: each token weighs ``phi(w) |A|``.

Along the path ``s_pos`` falls and ``s_neg`` rises; for SAPO that raises every positive weight and lowers every
negative one (``g_tau(r)`` falls with ``tau`` for ``r != 1``), so the share rises monotonically. For VESPO, ``phi``
exceeds 1 near its peak, where flattening LOWERS the weight: the share need not be monotone along the path (the
search takes the first candidate meeting the target, as it does for the value share's ``c_low``).

No histogram is possible (the weight is smooth in ``r``), so the sums cost ``O(tokens x grid)`` memory (``H + L``
grid values, 52 with the defaults: 27 MB in float64 for 64k tokens); still ONE collective and no host sync.
"""

from __future__ import annotations

import math

import torch

from .clipping import SearchPath, _device_grids, prepared

#: TRL clamps VESPO's lambda at this floor (``get_gamma_weights``).
VESPO_LAMBDA_MIN = 1e-4
#: TRL clamps VESPO's log sequence weight to ``[log(1e-8), 20]``.
VESPO_LOG_W = (math.log(1e-8), 20.0)


def positive_scale(c_high, upper_start: float):
    """``s_pos``: the positive gate's sharpness at ``c_high``, relative to the start ``a+`` (floats or tensors)."""
    return (upper_start - 1.0) / (c_high - 1.0)


def negative_scale(c_low, lower_start: float):
    """``s_neg``: the negative gate's sharpness at ``c_low``, relative to the start ``a-``."""
    return (1.0 - lower_start) / (1.0 - c_low)


def sapo_weight(r: torch.Tensor, tau) -> torch.Tensor:
    """``g_tau(r) r``: the weight of a SAPO token's gradient per unit ``|A|``. ``g = 4 e^{-|x|} / (1 + e^{-|x|})^2``
    (``= 4 sigmoid(x) (1 - sigmoid(x))``, written so that it cannot overflow) with ``x = tau (r - 1)``."""
    e = torch.exp(-(tau * (r - 1.0)).abs())
    return 4.0 * e / (1.0 + e) ** 2 * r


def vespo_weight(log_w: torch.Tensor, k, lam) -> torch.Tensor:
    """``phi(w) = exp(lambda + k log w - lambda w)`` (TRL's ``get_gamma_weights`` with ``lambda`` floored as TRL does),
    from ``log w``."""
    lam = torch.as_tensor(lam, dtype=log_w.dtype, device=log_w.device).clamp(min=VESPO_LAMBDA_MIN)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor,
                      importance_sampling_ratio: torch.Tensor | None) -> torch.Tensor:
    """``(B, 1)`` log of VESPO's sequence weight ``w`` exactly as TRL's ``get_gamma_weights`` forms it: the SUM of the
    token log-ratios (each clamped to ``[-20, 20]``) over the loss mask, plus the sum of the log vLLM IS weights
    (clamped to ``[log 1e-8, 20]``) when there are any, clamped to ``[log 1e-8, 20]``."""
    low, high = VESPO_LOG_W
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(importance_sampling_ratio), low, high).sum(-1, keepdim=True)
    return log_w.clamp(low, high)


def _gate_sums(ratio, advantages, mask, path: SearchPath, weight_fn, pos_params, neg_params) -> torch.Tensor:
    """``[pos(H), pos(H), neg(L), neg(L), num_tokens, num_nonfinite]``: ``pos`` at every ``c_high`` of the path,
    ``neg`` at every ``c_low`` (the layout of :func:`bapo_trl.core.clipping.grid_sums`, value and gradient share
    equal). ``weight_fn(r, *params)`` is a token's gradient weight per unit ``|A|``; ``params`` are
    ``(grid, 1)`` tensors."""
    r, a, weight, counts = prepared(ratio, advantages, mask)
    r, positive = r.flatten(), (a > 0).expand_as(weight).flatten()
    weight = weight.flatten()
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    pos = (weight_fn(r, *pos_params) * torch.where(positive, weight, zero)).sum(-1)
    neg = (weight_fn(r, *neg_params) * torch.where(positive, zero, weight)).sum(-1)
    return torch.cat([pos, pos, neg, neg, counts])


def _scales(path: SearchPath, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, 1)`` ``s_pos`` and ``(L, 1)`` ``s_neg`` of the path's grids (the start is each grid's first point)."""
    high, low = _device_grids(path, device)
    return (positive_scale(high, path.high_grid[0])[:, None], negative_scale(low, path.low_grid[0])[:, None])


def sapo_sums(ratio, advantages, mask, path: SearchPath, *, sapo_temperature_pos: float,
              sapo_temperature_neg: float, **_) -> torch.Tensor:
    """SAPO's share sums: ``pos = sum_{A>0} g_{tau+}(r) r A``, ``neg = sum_{A<0} g_{tau-}(r) r |A|`` with
    ``tau+ = s_pos(c_high) sapo_temperature_pos``, ``tau- = s_neg(c_low) sapo_temperature_neg``."""
    s_pos, s_neg = _scales(path, ratio.device)
    return _gate_sums(ratio, advantages, mask, path, sapo_weight, (s_pos * sapo_temperature_pos,),
                      (s_neg * sapo_temperature_neg,))


def vespo_sums(ratio, advantages, mask, path: SearchPath, *, vespo_k_pos: float, vespo_lambda_pos: float,
               vespo_k_neg: float, vespo_lambda_neg: float, **_) -> torch.Tensor:
    """VESPO's share sums (``ratio`` is the sequence weight ``w`` on every token): ``pos = sum_{A>0} phi_+(w) A``,
    ``neg = sum_{A<0} phi_-(w) |A|`` with each sign's ``(k, lambda)`` scaled by its ``s``."""
    s_pos, s_neg = _scales(path, ratio.device)

    def weight(w, k, lam):
        return vespo_weight(torch.log(w.clamp_min(1e-300)), k, lam)  # invalid tokens (w = 0, weight 0) stay finite

    return _gate_sums(ratio, advantages, mask, path, weight, (s_pos * vespo_k_pos, s_pos * vespo_lambda_pos),
                      (s_neg * vespo_k_neg, s_neg * vespo_lambda_neg))
