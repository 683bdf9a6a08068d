"""The off-policy guarantee rows (tests/support/guarantee_rows.py) on ``DecoupledBAPOTrainer``: the method's table
runs each rollout source on BAPOTrainer; here the same rows run on the decoupled correction, with its own check on
top: each trained token's proximal log-prob (the clip's reference) equals a recomputation with the policy of the step
its generation batch started training at."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from support.guarantee_rows import FAST, run_row
from support.harness import logps_under

#: The sources the decoupled correction runs on (the method's rows of the same names): replay (fast tier) and async
#: K=1 (slow), a stale batch of each kind; the proximal log-prob is the policy at the step a batch started training,
#: whatever generated it. A research candidate (bapo_trl/experimental): partial rollout, in-flight updates and LoRA
#: ran here too (all passed, 2026-11) until CI's time budget; their sources' own rows are in the method's table.
ROWS = ["replay", "async_k1"]
FAST_ROWS = {"replay"}


def check_proximal_logps(rows: list[dict], policies: dict, model_dir, updates: int, temperature: float,
                         atol: float, limit: int = 6, peft=None) -> int:
    """Each token's proximal log-prob = the policy of the step its generation batch started training at (``updates``
    optimizer steps per batch), recomputed; returns how many rows were checked (the stalest first). A proximal
    log-prob equal to the behaviour one would pass only where they agree."""
    candidates = [r for r in rows if r["prox"] is not None and r["completion"]]
    candidates.sort(key=lambda r: min(r["versions"]) - r["step"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if peft is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft)
    for r in candidates[:limit]:
        start = r["step"] - r["step"] % updates
        ids = torch.tensor([list(r["prompt"]) + list(r["completion"])])
        expected = logps_under(model, policies[start], ids, len(r["completion"]), temperature)[0]
        assert torch.allclose(expected, torch.tensor(r["prox"]), atol=atol), (r["step"], start, expected, r["prox"])
    return min(len(candidates), limit)


def decoupled_checks(trainer, rows, policies, model_dir, args, peft) -> None:
    assert check_proximal_logps(rows, policies, model_dir, args.updates_per_generation, args.temperature, 2e-4,
                                peft=peft) > 0
    assert any("decoupled/ess" in h for h in trainer.state.log_history)


@pytest.mark.side_by_side
@pytest.mark.parametrize("source", [s if s in FAST_ROWS else pytest.param(s, marks=pytest.mark.slow) for s in ROWS])
def test_the_guarantee_rows_hold_on_the_decoupled_correction(source, tiny_model_dir, tmp_path):
    from bapo_trl.experimental.decoupled import DecoupledBAPOConfig, DecoupledBAPOTrainer

    run_row(source, FAST, tiny_model_dir, tmp_path, classes=(DecoupledBAPOConfig, DecoupledBAPOTrainer),
            check=decoupled_checks)
