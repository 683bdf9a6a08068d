"""TRL as the oracle where BAPO must equal it (issue 75): on a batch with every ratio exactly 1 (on-policy data),
``BAPOConfig(**C)`` on ``BAPOTrainer`` gives ``GRPOConfig(**C)`` on TRL's ``GRPOTrainer``'s loss and gradient, for
every loss type TRL ships, both ratio levels and windows drawn across TRL's valid range (Hypothesis; derandomised in
CI); or ``C`` is refused when ``BAPOConfig`` is built, naming the field. CISPO with its cap unset was the case this
would have caught: 5x TRL's gradient, while the config said "BAPO equals GRPO"."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trl import GRPOConfig, GRPOTrainer

from bapo_trl import BAPOConfig, BAPOTrainer
from support.trainers import make_trainer, stale_batch

#: (loss_type, importance_sampling_level) pairs TRL's GRPOConfig accepts.
CASES = [(loss, level) for loss in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
         for level in ("token", "sequence") if not (loss == "luspo" and level == "token")]


def windows():
    """A window as a TRL user sets it: ``epsilon`` across (0, 1), ``epsilon_high`` unset or across (0, 6] (a CISPO
    cap lives above 1; a clipped loss's half-width below), ``delta`` unset or above 1."""
    return st.fixed_dictionaries({
        "epsilon": st.floats(0.001, 0.95),
        "epsilon_high": st.one_of(st.none(), st.floats(0.001, 6.0)),
        "delta": st.one_of(st.none(), st.floats(1.05, 8.0)),
    })


def on_policy_batch(trainer) -> dict:
    """A micro-batch with no ``old_per_token_logps``: TRL then takes the current log-probs, every ratio exactly 1."""
    batch = stale_batch(trainer, seed=3, noise=0.0)
    batch.pop("old_per_token_logps")
    return batch


def loss_and_gradient(trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grad


@pytest.mark.parametrize("loss_type,level", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(window=windows())
def test_on_policy_bapo_trains_trls_gradient_or_refuses_the_config(loss_type, level, window, tiny_model_dir,
                                                                    tmp_path_factory):
    kw = dict(loss_type=loss_type, importance_sampling_level=level,
              **{k: v for k, v in window.items() if v is not None})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            GRPOConfig(output_dir="unused", use_cpu=True, **kw)
        except ValueError:
            return  # TRL refuses it: nothing for BAPO to equal
        try:
            BAPOConfig(output_dir="unused", use_cpu=True, **kw)
        except ValueError as refusal:  # refused by name, before anything is built
            assert any(f"`{name}`" in str(refusal) for name in window), str(refusal)
            return
        folder = tmp_path_factory.mktemp("oracle")
        bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, folder / "bapo", **kw)
        trl = make_trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, folder / "trl", **kw)
    batch = on_policy_batch(bapo)
    loss_b, grad_b = loss_and_gradient(bapo, batch)
    loss_t, grad_t = loss_and_gradient(trl, batch)
    scale = grad_t.abs().max().clamp_min(1e-12)
    assert torch.allclose(loss_b, loss_t, rtol=1e-6, atol=1e-7), (kw, loss_b, loss_t)
    assert float((grad_b - grad_t).abs().max() / scale) < 1e-5, (kw, float((grad_b - grad_t).abs().max()),
                                                                 float(scale))


def pinned(loss_type: str, window: dict) -> dict:
    """The ``ratio_*`` fields of a one-point path at TRL's own window for this loss (a cap for CISPO; the gates'
    start, where their scale is 1), and the dual clip off unless ``delta`` is set (TRL has none by default)."""
    eps = window.get("epsilon", 0.2)
    high = window.get("epsilon_high") or eps
    upper = high if loss_type == "cispo" else 1 + high
    lower = 1 - eps if loss_type not in ("sapo", "vespo") else 0.6
    upper = 1.2 if loss_type in ("sapo", "vespo") else upper
    return dict(ratio_lower_start=lower, ratio_lower_max=lower, ratio_lower_step=0.01, ratio_upper_start=upper,
                ratio_upper_max=upper, ratio_upper_step=0.01, dual_clip=False)


#: Windows per ratio level, as their users set them (TRL's default, clip-higher, GSPO's documented one, with delta).
STALE_WINDOWS = {"token": [dict(), dict(epsilon=0.2, epsilon_high=0.28), dict(epsilon=0.3, delta=2.0)],
                 "sequence": [dict(epsilon=3e-4, epsilon_high=4e-4), dict(epsilon=0.2, delta=1.5)]}


@pytest.mark.parametrize("loss_type,level", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_with_the_path_pinned_to_trls_window_bapo_equals_trl_on_stale_data(loss_type, level, tiny_model_dir,
                                                                          tmp_path):
    """Pinned-window equivalence: with the ``ratio_*`` fields pinned to TRL's own window (one point), BAPO(C) is
    TRL(C) on stale batches too (behaviour log-probs perturbed by N(0, 0.7)): the search can only choose TRL's window,
    and every other part of the loss is TRL's."""
    compared = 0
    for index, window in enumerate(STALE_WINDOWS[level]):
        cap = dict(epsilon_high=5.0) if loss_type == "cispo" else {}
        kw = dict(loss_type=loss_type, importance_sampling_level=level, **{**window, **cap})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                GRPOConfig(output_dir="unused", use_cpu=True, **kw)
            except ValueError:
                continue
            bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / f"b{index}",
                                **kw, **pinned(loss_type, kw))
            trl = make_trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / f"t{index}", **kw)
        for seed in range(2):
            batch = stale_batch(bapo, seed=seed, noise=0.7)
            loss_b, grad_b = loss_and_gradient(bapo, batch)
            loss_t, grad_t = loss_and_gradient(trl, batch)
            scale = grad_t.abs().max().clamp_min(1e-12)
            assert torch.allclose(loss_b, loss_t, rtol=1e-6, atol=1e-7), (kw, seed, loss_b, loss_t)
            assert float((grad_b - grad_t).abs().max() / scale) < 1e-5, (kw, seed)
        compared += 1
    assert compared
