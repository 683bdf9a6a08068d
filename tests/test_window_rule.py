"""The rule that derives BAPO's search path from the window the user set (``bapo_trl.core.window_rule``): a TRL user
who swaps ``GRPOConfig`` for ``BAPOConfig`` keeps their ``epsilon``/``epsilon_high``/``importance_sampling_level``
and gets BAPO's balance around that window; the ``ratio_*`` fields they set override it."""

from __future__ import annotations

import pickle
import warnings

import pytest

from bapo_trl import BAPOConfig, gspo_balanced
from bapo_trl.core.clipping import BAPOSettings, search_path
from bapo_trl.core.loss_types import LOSS_TYPES
from bapo_trl.core.window_rule import PAPER_PATH, RATIO_FIELDS, derived_path, window_path
from bapo_trl.trainer.presets import GSPO_DOCUMENTED


def config(**settings) -> BAPOConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BAPOConfig(output_dir="unused", use_cpu=True, **settings)


def ratio_fields(source) -> dict:
    return {name: (source[name] if isinstance(source, dict) else source.search_path[name]) for name in RATIO_FIELDS}


def grids(settings: BAPOSettings, loss_type: str = "dapo"):
    path = LOSS_TYPES[loss_type].path(settings)
    return [float(x) for x in path.clip_low], [float(x) for x in path.clip_high]


def test_trls_defaults_search_exactly_the_papers_path():
    """TRL's defaults (dapo, epsilon 0.2, token ratios): the paper's six numbers, and the search's candidates are
    those of the paper's settings (the core's defaults) point for point."""
    c = config()
    assert ratio_fields(c) == PAPER_PATH == ratio_fields(BAPOSettings().__dict__)
    assert grids(c.bapo_settings) == grids(BAPOSettings(delta=3.0))
    assert c.ratio_fields_set == () and c.search_path_origin.startswith("the paper's path")


def test_gspo_as_trl_documents_it_searches_gspo_balanced():
    """The documented GSPO config as it is (no named setting): gspo_balanced()'s path, issue 53's confirmed choice."""
    documented, balanced = config(**GSPO_DOCUMENTED), config(**gspo_balanced())
    assert ratio_fields(documented) == ratio_fields(gspo_balanced())
    assert grids(documented.bapo_settings, "grpo") == grids(balanced.bapo_settings, "grpo")
    assert documented.search_path_origin == ("around your window [0.9997, 1.0004] (sequence ratios): c_high "
                                             "1.0004..1.04, c_low 0.991..0.9997")
    assert balanced.search_path_origin == "your ratio_* settings"


@pytest.mark.parametrize("settings,expected", [
    (dict(epsilon=0.2, epsilon_high=0.28), dict(ratio_upper_start=1.28, ratio_upper_max=3.8, ratio_upper_step=0.07,
                                                ratio_lower_start=0.6, ratio_lower_max=0.9)),
    (dict(epsilon=0.1), dict(ratio_upper_start=1.1, ratio_upper_max=2.0, ratio_lower_start=0.8,
                             ratio_lower_max=0.95)),
    (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=1e-3),
     dict(ratio_upper_start=1.001, ratio_upper_max=1.1, ratio_lower_start=0.97, ratio_lower_max=0.999)),
    (dict(loss_type="cispo", epsilon_high=5.0), dict(ratio_upper_start=5.0, ratio_upper_max=41.0)),
], ids=["clip_higher", "epsilon_0.1", "sequence_1e-3", "cispo_documented"])
def test_the_path_starts_at_the_users_window(settings, expected):
    c = config(**settings)
    for name, value in expected.items():
        assert c.search_path[name] == pytest.approx(value, rel=1e-12), name
    path = search_path(c.bapo_settings)
    assert path.high_grid[0] == pytest.approx(expected["ratio_upper_start"])  # the first candidate: the user's bound
    assert len(path.high_grid) == 37 and len(path.low_grid) == 16


@pytest.mark.parametrize("settings,why", [
    (dict(loss_type="sapo"), "gate loss"),
    (dict(loss_type="vespo", epsilon=0.1), "gate loss"),
    # 1 - 30 x 0.2 < 0: the sequence level's widening has no room, the token level's is the paper's
    (dict(loss_type="grpo", importance_sampling_level="sequence"), "TRL's default window"),
], ids=["sapo", "vespo", "sequence_epsilon_0.2"])
def test_without_a_window_to_start_from_the_path_is_the_papers_and_says_why(settings, why):
    c = config(**settings)
    assert ratio_fields(c) == PAPER_PATH
    assert c.search_path_origin.startswith("the paper's path") and why in c.search_path_origin


@pytest.mark.parametrize("settings,named", [
    (dict(epsilon=-1), "`epsilon` must be a number > 0"),
    (dict(epsilon=0.0), "`epsilon` must be a number > 0"),
    (dict(epsilon_high=0.0), "`epsilon_high` must be a number > 0"),
    (dict(epsilon=0.2, epsilon_high=-0.1, loss_type="grpo"), "`epsilon_high` must be a number > 0"),
    (dict(loss_type="cispo"), "needs `epsilon_high` > 1.*TRL documents 5.0.*epsilon_high unset, read as epsilon=0.2"),
    (dict(loss_type="cispo", epsilon_high=1.0), "needs `epsilon_high` > 1.*epsilon_high=1.0"),
], ids=["epsilon_-1", "epsilon_0", "epsilon_high_0", "epsilon_high_negative", "cispo_unset", "cispo_1"])
def test_a_window_that_is_no_window_is_refused_naming_the_field(settings, named):
    """Issue 75, findings 3 and 5: every TRL field the rule reads is checked when the config is built. CISPO's unset
    cap is TRL's epsilon 0.2, which would cap every on-policy weight at 0.2 (BAPO's path starts above 1: 5x TRL's
    gradient); a negative or zero half-width was accepted and searched the paper's path."""
    with pytest.raises(ValueError, match=named):
        config(steps_per_generation=2, **settings)


@pytest.mark.parametrize("settings,c_high,clamped", [
    (dict(epsilon=0.5, epsilon_high=0.6), 1.6, True),  # exactly at the token boundary 1 - 2 x 0.5 = 0
    (dict(epsilon=0.49, epsilon_high=0.6), 1.6, False),
    (dict(epsilon=1 / 30, importance_sampling_level="sequence", loss_type="grpo"), 1 + 1 / 30, False),  # token W
    (dict(epsilon=3.0), 4.0, True),  # TRL's lower bound below 0
], ids=["token_0.5", "token_0.49", "sequence_1/30", "epsilon_3"])
def test_a_window_the_rule_cannot_widen_below_keeps_the_users_c_high_and_warns(settings, c_high, clamped):
    """Issue 75, finding 5: a window too wide to widen c_low below it (``1 - W epsilon <= 0``) kept the paper's path,
    c_high from 1.2, narrower than TRL's own window; now c_high starts at the user's bound and only c_low's widest is
    clamped, with a warning from Python (``bapo train`` prints the config's warnings). The boundary is exact:
    ``epsilon = 0.5`` at token level clamps, 0.49 does not."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = BAPOConfig(output_dir="unused", use_cpu=True, steps_per_generation=2, **settings)
    said = [str(w.message) for w in caught if "leaves no room to widen c_low" in str(w.message)]
    path = c.search_path
    assert path["ratio_upper_start"] == pytest.approx(c_high)
    assert search_path(c.bapo_settings).high_grid[0] == pytest.approx(c_high)
    assert 0 < path["ratio_lower_start"] < path["ratio_lower_max"] < 1 and path["ratio_lower_step"] > 0
    assert bool(said) == clamped and ("clamped" in c.search_path_origin) == clamped, (said, c.search_path_origin)
    if clamped:
        assert path["ratio_lower_start"] == pytest.approx(path["ratio_lower_max"] / 4)
    else:
        assert path["ratio_lower_start"] == pytest.approx(1 - 2 * settings["epsilon"])


def test_ratio_fields_the_user_sets_override_the_rule():
    every = dict(ratio_lower_start=0.7, ratio_lower_max=0.85, ratio_lower_step=0.05, ratio_upper_start=1.3,
                 ratio_upper_max=2.0, ratio_upper_step=0.1)
    c = config(epsilon=0.1, **every)
    assert ratio_fields(c) == every and c.search_path_origin == "your ratio_* settings"
    one = config(**GSPO_DOCUMENTED, ratio_upper_max=1.1)
    assert (one.search_path["ratio_upper_max"], one.search_path["ratio_upper_start"],
            one.search_path["ratio_lower_start"]) == (1.1, 1.0004, 0.991)
    assert one.ratio_fields_set == ("ratio_upper_max",)
    assert one.search_path_origin.endswith("; your ratio_upper_max overrides the rule")
    again = pickle.loads(pickle.dumps(one))  # as a checkpoint's training_args.bin keeps it
    assert ratio_fields(again) == ratio_fields(one) and again.search_path_origin == one.search_path_origin


def test_epsilon_is_no_longer_reported_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BAPOConfig(output_dir="unused", use_cpu=True, epsilon=0.3, epsilon_high=0.4, steps_per_generation=2)
    assert not [w for w in caught if "BAPO" in str(w.message) and "epsilon" in str(w.message)]


def test_the_rule_is_the_formula_of_its_docstring():
    """c_high from 1 + h to 1 + U h in 37 points, c_low from 1 - W e to 1 - N e in 16 (token U, W, N = 10, 2, 0.5;
    sequence 100, 30, 1), checked against the formula on other windows than the ones pinned above."""
    for level, factors in {"token": (10, 2, 0.5), "sequence": (100, 30, 1)}.items():
        for e, h in [(0.05, 0.07), (1e-3, 2e-3), (0.01, None)]:
            high = e if h is None else h
            # a sequence window with no room for 30 half-widths below it takes the token level's widening
            u, w, n = (10, 2, 0.5) if level == "sequence" and 30 * e >= 1 else factors
            path = window_path(e, h, level)
            assert path["ratio_upper_start"] == pytest.approx(1 + high)
            assert path["ratio_upper_max"] == pytest.approx(1 + u * high)
            assert path["ratio_upper_step"] == pytest.approx((u - 1) * high / 36)
            assert path["ratio_lower_start"] == pytest.approx(1 - w * e)
            assert path["ratio_lower_max"] == pytest.approx(1 - n * e)
            assert path["ratio_lower_step"] == pytest.approx((w - n) * e / 15)
    assert derived_path("clip", 0.2, None, "token")[0] == PAPER_PATH


def test_the_rule_runs_once_at_config_time_and_never_during_training(tiny_model_dir, tmp_path, monkeypatch):
    """No per-step cost: the path is derived when the config is built; a run on it (stale steps, the search run at
    every update) never calls the rule again, and trains on the same settings as the explicit fields would."""
    from bapo_trl.trainer import bapo_config
    from support.harness import cpu_config, tiny_trainer

    calls = []
    rule = bapo_config.derived_path
    monkeypatch.setattr(bapo_config, "derived_path", lambda *a, **k: calls.append(a) or rule(*a, **k))
    args = cpu_config(tmp_path, **GSPO_DOCUMENTED, per_device_train_batch_size=8, num_generations=4,
                      steps_per_generation=4, max_steps=4, max_completion_length=6, logging_steps=1,
                      save_strategy="no")
    assert len(calls) == 1
    trainer = tiny_trainer(tiny_model_dir, args)
    trainer.train()
    assert len(calls) == 1 and trainer.last_search is not None  # the search ran at every update
    assert trainer._bapo_settings == config(**gspo_balanced()).bapo_settings


def test_a_config_rebuilt_from_another_configs_values_derives_its_own_path(tmp_path):
    """Issue 75, finding 6: the rule's values never pass for the user's. The ``ratio_*`` fields keep None where unset
    and the dual clip's ``delta`` is kept apart (``effective_delta``), so ``dataclasses.replace``,
    ``BAPOConfig(**to_dict())`` and a saved YAML read back by ``bapo train --config`` derive the path of THEIR
    window (a sweep over ``epsilon`` searched the first value's path every time), and ``dual_clip=False`` on a rebuilt
    config has no dual clip left over."""
    import dataclasses

    import yaml

    from bapo_trl.cli.train import parse_args

    first = config(steps_per_generation=2)
    assert first.ratio_fields_set == () and all(getattr(first, name) is None for name in RATIO_FIELDS)
    assert first.delta is None and first.effective_delta == 3.0
    expected = window_path(0.1, None, "token")
    # generation_batch_size: GRPOConfig writes its own derived value there (and refuses it beside
    # steps_per_generation): TRL's config does not rebuild from its to_dict() either
    values = {k: v for k, v in first.to_dict().items() if k in {f.name for f in dataclasses.fields(BAPOConfig)}
              and k != "generation_batch_size"}
    again = dict(generation_batch_size=None)  # TRL's GRPOConfig rebuilds only with one of its two batch fields
    for rebuilt in (dataclasses.replace(first, epsilon=0.1, **again), BAPOConfig(**{**values, "epsilon": 0.1})):
        assert ratio_fields(rebuilt) == expected and rebuilt.search_path_origin.startswith("around your window [0.9")
        assert search_path(rebuilt.bapo_settings).high_grid[0] == pytest.approx(1.1)
    assert dataclasses.replace(first, dual_clip=False, **again).effective_delta is None
    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump({k: v for k, v in values.items() if k.startswith(("ratio_", "epsilon", "delta"))
                                      or k in ("dual_clip", "steps_per_generation")}))
    _, from_yaml, _ = parse_args(["--config", str(recipe), "--epsilon", "0.1", "--output_dir", str(tmp_path / "o")])
    assert ratio_fields(from_yaml) == expected
    moved = config(steps_per_generation=2)
    moved.epsilon = 0.1  # set after construction: the path follows the window the config holds
    assert ratio_fields(moved) == expected
