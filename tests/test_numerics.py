"""Property tests: the search terminates with sane output and the loss stays finite for anything a trainer can
produce (NaN/inf on padding, extreme ratios, empty masks, one token, all-positive/negative/zero advantages,
half-precision inputs)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from bapo_trl import search_clip_bounds
from bapo_trl.core.clipping import BAPOSettings, search_path
from bapo_trl.core.numerics import loss_mask, sanitize_micro_batch
from support.harness import cpu_config, tiny_trainer

NASTY = [math.nan, math.inf, -math.inf, 1e30, 1e-30, 0.0, 1e38]
ratio_values = st.floats(1e-30, 1e30, allow_nan=False) | st.sampled_from([1.0, 0.6, 1.2, 3.0, 1e-30, 1e30])
adv_values = st.sampled_from([0.0, 1.0, -1.0, 1e-12, -1e12]) | st.floats(-1e6, 1e6, allow_nan=False)


@st.composite
def hostile_batches(draw):
    batch, length = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    n = batch * length
    ratio = torch.tensor(draw(st.lists(ratio_values, min_size=n, max_size=n)), dtype=torch.float64).view(batch, length)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(batch, length)
    junk = torch.tensor(draw(st.lists(st.sampled_from(NASTY), min_size=n, max_size=n)), dtype=torch.float64)
    ratio = torch.where(mask, ratio, junk.view(batch, length))  # garbage wherever the mask is off
    kind = draw(st.sampled_from(["mixed", "positive", "negative", "zero"]))
    adv = torch.tensor(draw(st.lists(adv_values, min_size=batch, max_size=batch)), dtype=torch.float64)
    adv = {"mixed": adv, "positive": adv.abs() + 0.1, "negative": -adv.abs() - 0.1, "zero": adv * 0}[kind]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    return ratio.to(dtype), adv.to(dtype), mask


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=hostile_batches(), variant=st.sampled_from(["paper", "verl"]), mode=st.sampled_from(["value", "gradient"]))
def test_search_always_terminates_with_a_window_on_the_path(data, variant, mode):
    ratio, adv, mask = data
    res = search_clip_bounds(ratio, adv, mask, bapo_variant=variant, positive_contribution_mode=mode).as_floats()
    path = search_path(BAPOSettings(bapo_variant=variant, positive_contribution_mode=mode))
    steps = int(res["steps"])
    assert res["steps"] == steps and 0 <= steps < len(path) == 52
    # the window is the path's candidate number `steps`, not just some point of its bounding box
    assert res["clip_low"] == pytest.approx(path.clip_low[steps], abs=1e-6)
    assert res["clip_high"] == pytest.approx(path.clip_high[steps], abs=1e-6)
    assert math.isnan(res["positive_contribution"]) or 0.0 <= res["positive_contribution"] <= 1.0
    assert math.isfinite(res["num_tokens"]) and res["num_tokens"] <= int(mask.sum())
    if not mask.any():
        assert res["steps"] == 0 and res["target_met"] == 1.0


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    args = cpu_config(tmp_path_factory.mktemp("num"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, beta=0.04)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()
    t = tiny_trainer(tiny_model_dir, args, model=model, prompts=8)
    t.current_gradient_accumulation_steps = 1
    return t


logp_values = st.floats(-1e4, 0.0, allow_nan=False) | st.sampled_from([math.nan, -math.inf, math.inf, -1e30, 0.0])


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(old=st.lists(logp_values, min_size=24, max_size=24), ref=st.lists(logp_values, min_size=24, max_size=24),
       mask=st.lists(st.booleans(), min_size=24, max_size=24),
       adv=st.lists(adv_values | st.sampled_from([math.nan, math.inf]), min_size=4, max_size=4),
       seed=st.integers(0, 5))
def test_loss_and_gradient_stay_finite(trainer, old, ref, mask, adv, seed):
    gen = torch.Generator().manual_seed(seed)
    tok = trainer.processing_class
    prompts = tok(["123>", "45>", "6>", "789>"], return_tensors="pt", padding=True)
    inputs = {
        "prompt_ids": prompts.input_ids,
        "prompt_mask": prompts.attention_mask,
        "completion_ids": torch.randint(6, len(tok), (4, 6), generator=gen),
        "completion_mask": torch.tensor(mask, dtype=torch.long).view(4, 6),
        "old_per_token_logps": torch.tensor(old, dtype=torch.float32).view(4, 6),
        "ref_per_token_logps": torch.tensor(ref, dtype=torch.float32).view(4, 6),
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "num_items_in_batch": torch.tensor(float(sum(mask))),
    }
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    assert torch.isfinite(loss), loss
    loss.backward()
    for p in trainer.model.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


def test_sanitize_masks_real_nonfinite_tokens_and_counts_them():
    current = torch.zeros(2, 3)
    inputs = {
        "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "old_per_token_logps": torch.tensor([[math.nan, -1.0, math.nan], [-1e9, 0.0, -math.inf]]),
        "advantages": torch.tensor([1.0, math.nan]),
    }
    bad = sanitize_micro_batch(inputs, current)
    # real NaN at (0,0), every real token of row 1 (NaN advantage); the padded NaN at (0,2) is not counted
    assert int(bad) == 4
    assert loss_mask(inputs).tolist() == [[0, 1, 0], [0, 0, 0]]  # out of the loss...
    assert inputs["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]  # ...not out of the attention
    assert torch.isfinite(inputs["old_per_token_logps"]).all()
    assert inputs["old_per_token_logps"].min() >= -20.0  # log-ratio clamp
    keep = {"completion_mask": torch.tensor([[1, 1]]), "old_per_token_logps": torch.tensor([[math.nan, 0.0]]),
            "advantages": torch.tensor([1.0])}
    assert int(sanitize_micro_batch(keep, torch.zeros(1, 2), mask_nonfinite=False)) == 1
    assert loss_mask(keep).tolist() == [[1, 1]]  # counted but not masked when switched off


def _scripted_inputs(trainer, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tok = trainer.processing_class
    prompts = tok(["123>", "45>", "6>", "789>"], return_tensors="pt", padding=True)
    return {
        "prompt_ids": prompts.input_ids,
        "prompt_mask": prompts.attention_mask,
        "completion_ids": torch.randint(6, len(tok), (4, 6), generator=gen),
        "completion_mask": torch.ones(4, 6, dtype=torch.long),
        "old_per_token_logps": -torch.rand(4, 6, generator=gen) * 3,
        "ref_per_token_logps": -torch.rand(4, 6, generator=gen) * 3,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "num_items_in_batch": torch.tensor(24.0),
    }


def test_a_real_token_with_a_nonfinite_input_leaves_the_loss_but_not_the_context(trainer):
    """The loss itself (not the inputs dict): a real token whose behaviour log-prob is NaN contributes exactly what a
    token masked out of the loss by hand contributes (TRL's ``tool_mask``, as for tool results), nothing; it is not
    kept at a neutral ratio of 1 inside TRL's loss. And it stays in the attention: the later tokens of its completion
    are scored with it in their context, as their behaviour and reference log-probs were. Dropping it from the
    attention as well (zeroing ``completion_mask``, what bapo_trl did before) gives another loss."""
    poisoned, by_hand, no_context = (_scripted_inputs(trainer) for _ in range(3))
    poisoned["old_per_token_logps"][1, 2] = math.nan
    poisoned["ref_per_token_logps"][3, 4] = math.inf
    by_hand["tool_mask"] = torch.ones(4, 6, dtype=torch.long)
    by_hand["tool_mask"][1, 2] = by_hand["tool_mask"][3, 4] = 0
    no_context["completion_mask"][1, 2] = no_context["completion_mask"][3, 4] = 0
    with torch.no_grad():
        loss_poisoned = trainer.compute_loss(trainer.model, poisoned)
        loss_by_hand = trainer.compute_loss(trainer.model, by_hand)
        loss_no_context = trainer.compute_loss(trainer.model, no_context)
    assert torch.isfinite(loss_poisoned)
    assert torch.allclose(loss_poisoned, loss_by_hand, atol=1e-6), (loss_poisoned, loss_by_hand)
    assert poisoned["completion_mask"].tolist() == [[1] * 6] * 4  # the attention mask TRL builds is untouched
    assert not torch.allclose(loss_poisoned, loss_no_context, atol=1e-6), (loss_poisoned, loss_no_context)
    with torch.no_grad():  # and the token does change the loss when it is finite: the comparison can fail
        assert not torch.allclose(trainer.compute_loss(trainer.model, _scripted_inputs(trainer)), loss_by_hand)


def test_each_loss_call_reads_the_batch_as_given_as_trls_num_iterations_reuse_it(trainer):
    """TRL trains its buffered batch ``num_iterations`` times, handing the same dict to every loss call. BAPO's
    sanitising (NaN filled, log-ratios clamped against THIS forward, a non-finite token dropped through
    ``tool_mask``) works on a copy: the batch is left as it was, and a later call after the policy moved computes
    what a fresh copy of the batch gives. Seen failing when the edits landed in the caller's dict (the second
    iteration's ratio then read the first iteration's policy)."""
    batch = _scripted_inputs(trainer, seed=4)
    batch["old_per_token_logps"][0, 1] = -60.0  # past max_log_ratio from any current log-prob
    batch["old_per_token_logps"][2, 3] = math.nan
    batch["ref_per_token_logps"][1, 0] = math.inf
    given = {key: value.clone() for key, value in batch.items()}
    weights = {key: value.clone() for key, value in trainer.model.state_dict().items()}
    try:
        with torch.no_grad():
            trainer.compute_loss(trainer.model, batch)
            assert set(batch) == set(given)
            for key, value in given.items():
                assert torch.equal(batch[key].nan_to_num(1.5), value.nan_to_num(1.5)), key
            for parameter in trainer.model.parameters():  # the policy moves between two iterations
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
            again = trainer.compute_loss(trainer.model, batch)
            fresh = trainer.compute_loss(trainer.model, {key: value.clone() for key, value in given.items()})
        assert torch.isfinite(again) and torch.equal(again, fresh), (again, fresh)
    finally:
        trainer.model.load_state_dict(weights)


@pytest.mark.parametrize("dtype, kept, clamped", [(torch.float32, 40.0, 50.0), (torch.bfloat16, 40.0, 50.0),
                                                  (torch.float16, 9.0, 10.5)])
def test_the_reference_log_ratio_is_trls_but_where_its_exp_overflows_or_nearly_does(dtype, kept, clamped):
    """TRL's KL term reads ``exp(ref - logp)``: a reference log-prob ``kept`` nats above the policy's, or 60 below, is
    left as TRL has it; ``clamped`` nats above is brought to the limit (44 nats in float32 and bfloat16, 10 in
    float16, where TRL's own term is finite up to 11), and garbage far below (30,000 nats) to 10,000 nats below."""
    from bapo_trl.core.numerics import REFERENCE_FLOOR, reference_log_ratio_limit, sanitize_after_forward

    current = torch.full((1, 4), -2.0, dtype=dtype)
    ref = (current + torch.tensor([[kept, clamped, -60.0, -3e4]])).to(dtype)
    inputs = {"completion_mask": torch.ones(1, 4), "advantages": torch.tensor([1.0]), "ref_per_token_logps": ref}
    sanitize_after_forward(inputs, current)
    expected = torch.stack([ref[0, 0], current[0, 1] + reference_log_ratio_limit(dtype), ref[0, 2],
                            current[0, 3] - REFERENCE_FLOOR])
    assert torch.equal(inputs["ref_per_token_logps"][0], expected.to(dtype))
    assert torch.isfinite(torch.exp(inputs["ref_per_token_logps"] - current)).all()


def test_the_behaviour_log_ratio_is_clamped_and_the_samplers_log_probs_are_left_as_they_are():
    """``old_per_token_logps`` (the ratio's denominator) is brought within ``max_log_ratio`` of the policy's; the
    sampler's own log-probs, which only TRL's off-policy mask reads (as a difference, no ``exp``), keep their value 25
    nats off, as TRL has them (clamped, the mask kept a sequence TRL drops); a NaN among them is still the current
    log-prob (no divergence there, as TRL's ``nan_to_num``)."""
    from bapo_trl.core.numerics import sanitize_after_forward

    current = torch.full((1, 4), -2.0)
    far = current + torch.tensor([[25.0, -25.0, 0.5, float("nan")]])
    inputs = {"completion_mask": torch.ones(1, 4), "advantages": torch.tensor([-1.0]),
              "old_per_token_logps": far.clone(), "sampling_per_token_logps": far.clone()}
    sanitize_after_forward(inputs, current, max_log_ratio=20.0)
    assert inputs["old_per_token_logps"].tolist() == [[18.0, -22.0, -1.5, -2.0]]
    assert inputs["sampling_per_token_logps"].tolist() == [[23.0, -27.0, -1.5, -2.0]]
