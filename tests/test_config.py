"""Every bad BAPO setting fails at construction with a message naming the field, the value and the allowed range."""

import warnings

import pytest

from bapo_trl import BAPOConfig

BAD = [
    # (overrides, field named in the message, a fragment of the allowed range)
    (dict(positive_contribution_target=0.0), "positive_contribution_target", "(0, 1)"),
    (dict(positive_contribution_target=1.0), "positive_contribution_target", "(0, 1)"),
    (dict(positive_contribution_target=-0.2), "positive_contribution_target", "(0, 1)"),
    (dict(positive_contribution_target=float("nan")), "positive_contribution_target", "finite"),
    (dict(ratio_lower_start=0.0), "ratio_lower_start", "(0, 1]"),
    (dict(ratio_lower_start=1.1, ratio_lower_max=1.2), "ratio_lower_start", "(0, 1]"),
    (dict(ratio_lower_max=1.5), "ratio_lower_max", "(0, 1]"),
    (dict(ratio_lower_start=0.9, ratio_lower_max=0.8), "ratio_lower_start", "<= `ratio_lower_max`"),
    (dict(ratio_lower_step=0.0), "ratio_lower_step", "> 0"),
    (dict(ratio_lower_step=-0.02), "ratio_lower_step", "> 0"),
    (dict(ratio_upper_start=0.9), "ratio_upper_start", "[1, 1e6)"),
    (dict(ratio_upper_max=0.95, ratio_upper_start=0.9), "ratio_upper_max", "[1, 1e6)"),
    (dict(ratio_upper_start=2.0, ratio_upper_max=1.5), "ratio_upper_start", "<= `ratio_upper_max`"),
    (dict(ratio_upper_step=0.0), "ratio_upper_step", "> 0"),
    (dict(ratio_upper_step=float("inf")), "ratio_upper_step", "finite"),
    (dict(ratio_upper_step=1e-7), "ratio_upper_step", "10000"),
    (dict(ratio_upper_max=float("inf")), "ratio_upper_max", "finite"),
    (dict(bapo_variant="official"), "bapo_variant", "('paper', 'verl')"),
    (dict(positive_contribution_mode="share"), "positive_contribution_mode", "('value', 'gradient')"),
    (dict(loss_type="ppo"), "loss_type",
     "('dapo', 'bnpo', 'grpo', 'dr_grpo', 'luspo', 'cispo', 'sapo', 'vespo')"),
    (dict(importance_sampling_level="group"), "importance_sampling_level", "('token', 'sequence')"),
    (dict(use_liger_kernel=True), "use_liger_kernel", "False"),
    (dict(delta=1.1), "delta", ">= `ratio_upper_start`"),
    (dict(bapo_variant="verl", delta=1.1, ratio_upper_max=2.0), "delta", ">= `ratio_upper_start`"),
    (dict(loss_type="sapo", ratio_upper_start=1.0), "ratio_upper_start", "> 1 with loss_type='sapo'"),
    (dict(loss_type="sapo", sapo_temperature_neg=-1.0), "sapo_temperature_neg", "> 0"),
    # TRL's own refusal (its trainer, after the model loads), made at construction
    (dict(loss_type="vespo", use_vllm=True), "vllm_importance_sampling_mode", "('token_truncate', 'token_mask')"),
    (dict(positive_contribution_target="0.5x"), "positive_contribution_target", "finite"),
    (dict(partial_rollout_budget=0), "partial_rollout_budget", "[1, max_completion_length)"),
    (dict(partial_rollout_budget=64, max_completion_length=32), "partial_rollout_budget", "[1, 32)"),
    (dict(partial_rollout_budget=8, partial_rollout_max_resumes=0), "partial_rollout_max_resumes", ">= 1"),
    (dict(partial_rollout_budget=4, generation_kwargs={"stop": ["\n"]}), "generation_kwargs", "stop_token_ids"),
    (dict(partial_rollout_budget=4, generation_kwargs={"max_tokens": 8, "top_k": 5}), "generation_kwargs",
     "['max_tokens']"),
    (dict(partial_rollout_budget=4, generation_kwargs={"max_new_tokens": 8}), "generation_kwargs", "caps each round"),
    (dict(max_log_ratio=0.5), "max_log_ratio", "log(ratio_upper_max)"),
    (dict(replay_buffer_size=-1), "replay_buffer_size", ">= 0"),
    (dict(replay_buffer_size=4), "replay_buffer_size", "nothing is ever replayed"),
    (dict(replay_buffer_size=4, replay_ratio=0.5, replay_max_staleness=0), "replay_max_staleness", ">= 1"),
    (dict(replay_buffer_size=4, replay_ratio=0.5, replay_sampling="oldest"), "replay_sampling", "'uniform'"),
    (dict(replay_fill_zero_std_groups=True), "replay_buffer_size", ">= 1"),
    (dict(replay_buffer_size=8, replay_ratio=0.9, per_device_train_batch_size=16, replay_max_staleness=8),
     "replay_ratio", "below 0.75"),  # 2 groups per batch: 0.9 x 2 rounds to both
    # a built-in source named outright must be the one the settings turn on (the checks and bounds read them)
    (dict(rollout_source="async"), "rollout_source", "async_generation=True"),
    (dict(rollout_source="partial"), "rollout_source", "partial_rollout_budget set"),
    (dict(rollout_source="trl", partial_rollout_budget=4), "rollout_source", "turn on 'partial'"),
]


def value_shown(value, message: str) -> bool:
    """The bad value appears in the message (a dict of generation kwargs: one of its keys)."""
    if isinstance(value, bool):
        return True  # a flag: "must be False" names the only allowed value, so the bad one is implied
    if isinstance(value, dict):
        return any(repr(key) in message for key in value)
    return str(value) in message or repr(value) in message


@pytest.mark.parametrize("overrides,field,allowed", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_value_names_field_value_and_range(overrides, field, allowed):
    with pytest.raises(ValueError) as err:
        BAPOConfig(output_dir="unused", use_cpu=True, **overrides)
    message = str(err.value)
    assert f"`{field}`" in message
    assert allowed in message
    bad = {**overrides}.get(field, getattr(BAPOConfig, field, None))  # the offending value (or the default)
    assert value_shown(bad, message), (bad, message)


def test_all_errors_are_reported_together():
    with pytest.raises(ValueError) as err:
        BAPOConfig(output_dir="unused", use_cpu=True, positive_contribution_target=2, ratio_lower_step=0)
    assert "positive_contribution_target" in str(err.value) and "ratio_lower_step" in str(err.value)


def test_generation_kwargs_without_partial_rollout_are_left_to_trl():
    BAPOConfig(output_dir="unused", use_cpu=True, generation_kwargs={"stop": ["\n"], "max_tokens": 8})


def test_defaults_follow_the_spec():
    c = BAPOConfig(output_dir="unused", use_cpu=True)
    path = c.search_path
    assert (c.positive_contribution_target, path["ratio_lower_start"], path["ratio_lower_max"],
            path["ratio_lower_step"]) == (0.5, 0.6, 0.9, 0.02)
    assert (path["ratio_upper_start"], path["ratio_upper_max"], path["ratio_upper_step"]) == (1.2, 3.0, 0.05)
    assert (c.bapo_variant, c.positive_contribution_mode, c.loss_type) == ("paper", "value", "dapo")


def test_pinned_lower_bound_warns_that_upper_cannot_move():
    with pytest.warns(UserWarning, match="never runs"):
        BAPOConfig(output_dir="unused", use_cpu=True, ratio_lower_start=0.8, ratio_lower_max=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        # a fully pinned window is a legitimate fixed-clipping baseline (on stale data): no warning
        BAPOConfig(output_dir="unused", use_cpu=True, ratio_lower_start=0.8, ratio_lower_max=0.8,
                   ratio_upper_start=1.2, ratio_upper_max=1.2, steps_per_generation=2)


def test_gspo_balanced_is_the_studied_path_around_trls_documented_gspo_window():
    """The named setting issue 53's study chose: c_high from 1 + 4e-4 to 1 + 4e-2 (37 points), c_low from 1 - 9e-3 to
    1 - 3e-4 (16 points), the sequence-level ratio and loss grpo, no KL term, the dual clip on; a bad scale is
    refused naming the argument."""
    from bapo_trl import gspo_balanced
    from bapo_trl.core.clipping import search_path

    settings = gspo_balanced()
    config = BAPOConfig(output_dir="unused", use_cpu=True, **settings)
    assert (config.loss_type, config.importance_sampling_level, config.beta) == ("grpo", "sequence", 0.0)
    assert config.dual_clip and config.effective_delta == 3.0 and config.delta is None
    path = search_path(config.bapo_settings)
    assert len(path.high_grid) == 37 and len(path.low_grid) == 16
    assert path.high_grid[0] == pytest.approx(1.0004) and path.high_grid[-1] == pytest.approx(1.04)
    assert path.low_grid[0] == pytest.approx(0.991) and path.low_grid[-1] == pytest.approx(0.9997)
    assert gspo_balanced(1)["ratio_upper_max"] == pytest.approx(1.004)  # scale 1: 10 x GSPO's epsilon_high
    with pytest.raises(ValueError, match="gspo_balanced: `scale` must be a number >= 1, got 0.5"):
        gspo_balanced(0.5)


def test_the_documented_flags_of_gspo_balanced_give_its_fields():
    """docs/configuration.md prints gspo_balanced() as `bapo train` flags: parsed by the command's parser they give
    the same fields (a change to the setting that the page misses fails here)."""
    import re
    from pathlib import Path

    from bapo_trl import gspo_balanced
    from bapo_trl.cli.train import parse_args

    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    block = re.search(r"```bash\nbapo train (--model_name_or_path .*?)\n```", page, re.S)[1]
    flags = block.replace("\\\n", " ").split()
    _, args, _ = parse_args(["--output_dir", "unused", *flags], cuda_available=False)
    assert {name: getattr(args, name) for name in gspo_balanced()} == pytest.approx(gspo_balanced())


@pytest.mark.parametrize("fields", [dict(vllm_importance_sampling_mode="token_truncate"),
                                    dict(vllm_importance_sampling_mode="token_mask"),
                                    dict(vllm_importance_sampling_correction=False), dict(use_vllm=False)])
def test_vespo_with_vllm_builds_where_trl_accepts_it(fields):
    """The other side of TRL's VESPO refusal (in BAD): each setting TRL's trainer accepts builds."""
    BAPOConfig(output_dir="unused", use_cpu=True, loss_type="vespo", **{"use_vllm": True, **fields})
