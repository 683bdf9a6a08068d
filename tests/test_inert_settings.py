"""No setting that silently does nothing: each row of the table "Settings that would do nothing"
(docs/configuration.md), met as a user meets it, through train_bapo.py's own argument parsing
(bapo_trl.cli.train.parse_args, what the script runs) on top of the embedded default job, and one row through a
real ``python train_bapo.py`` process."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from bapo_trl.cli.train import parse_args

ROOT = Path(__file__).resolve().parents[1]

#: (flags, substrings of the one-line error): a feature the user turned on would never act.
ERRORS = [
    ("--replay_buffer_size 32 --replay_ratio 0.5 --replay_max_staleness 8",
     ["`replay_max_staleness` (8) is below the youngest age", "Set `replay_max_staleness` >= 15"]),
    ("--replay_buffer_size 8 --replay_ratio 0.01 --replay_max_staleness 64",
     ["`replay_ratio` (0.01) x 32 groups", "rounds to 0 replayed groups"]),
    ("--replay_buffer_size 8 --replay_ratio 0.99 --replay_max_staleness 64",
     ["`replay_ratio` (0.99) x 32 group(s)", "rounds to all 32", "Lower `replay_ratio` below 0.984"]),
    ("--replay_buffer_size 8", ["`replay_buffer_size` is 8 but nothing is ever replayed"]),
    ("--replay_ratio 0.5", ["needs a replay queue: set `replay_buffer_size` >= 1"]),
    ("--partial_rollout_budget 12", ["`partial_rollout_budget` must be an integer in [1, max_completion_length)"]),
    ("--delta 1.1", ["`delta` (1.1) must be >= `ratio_upper_start` (1.2)"]),
    ("--epsilon -1", ["`epsilon` must be a number > 0 with loss_type='dapo'"]),
    ("--loss_type cispo", ["loss_type='cispo' needs `epsilon_high` > 1", "TRL documents 5.0"]),
    ("--loss_type sapo --ratio_upper_start 1.0", ["`ratio_upper_start` must be > 1 with loss_type='sapo'"]),
    ("--partial_rollout_budget 4 --generation_kwargs {\"max_tokens\":8}",
     ["`generation_kwargs` keys ['max_tokens'] cannot be used with `partial_rollout_budget`"]),
    ("--async_generation --use_vllm --vllm_mode server --inflight_update_tokens 4 "
     "--generation_kwargs {\"stop\":[\"x\"]}",
     ["`generation_kwargs` keys ['stop'] cannot be used with `inflight_update_tokens`"]),
    ("--async_generation --use_vllm --vllm_mode server --inflight_update_tokens 12",
     ["`inflight_update_tokens` (12) must be below `max_completion_length` (12)"]),
    ("--rollout_source async", ["`rollout_source` 'async' is a built-in source", "turn on 'trl'"]),
    ("--replay_saves_generation", ["`replay_saves_generation` needs a replay queue"]),
]
#: (flags, substring of the warning): legitimate but a setting is useless.
WARNINGS = [
    ("--steps_per_generation 1", "the data is exactly on-policy"),
    ("--ratio_lower_start 0.8 --ratio_lower_max 0.8", "the paper's search loop never runs"),
    ("--ratio_lower_start 0.8 --ratio_lower_max 0.8 --ratio_upper_max 1.2 --positive_contribution_target 0.4",
     "single window [0.8, 1.2], so positive_contribution_target=0.4 only matter(s) for a moving search"),
    ("--replay_buffer_size 2 --replay_ratio 0.5 --replay_max_staleness 64", "`replay_ratio` is never reached"),
    ("--positive_contribution_is_weighted", "only acts on TRL's vLLM importance-sampling weights"),
    ("--replay_buffer_size 64 --replay_ratio 0.3 --replay_max_staleness 64",
     "is not a whole number of groups: 10 are replayed per batch (a ratio of 0.3125)"),
    ("--async_generation --use_vllm --vllm_mode server --positive_contribution_is_weighted "
     "--vllm_importance_sampling_mode token_truncate",
     "positive_contribution_is_weighted=True, vllm_importance_sampling_mode='token_truncate' have no effect on the "
     "batches async_generation samples"),
    ("--delta 2.0", "the upper search path ends at 2.0"),
    ("--epsilon 0.5", "leaves no room to widen c_low below it"),
    ("--loss_type sapo --delta 4.0", "`delta` (4.0) has no effect with loss_type='sapo'"),
    ("--loss_type cispo --epsilon_high 5.0 --ratio_lower_max 0.8", "have no effect with loss_type='cispo'"),
    ("--loss_type vespo --positive_contribution_mode gradient", "the value and the gradient share are one"),
    ("--loss_type vespo --positive_contribution_is_weighted", "TRL folds the vLLM importance-sampling weights"),
    ("--ratio_lower_start 0.8 --ratio_lower_max 0.8 --ratio_upper_max 1.2 --target_entropy 1.0",
     "so target_entropy=1.0 only matter(s) for a moving search"),
    ("--max_steps 2 --logging_steps 10", "`logging_steps` (10) exceeds `max_steps` (2): no training step will be "
     "logged"),
    ("--epsilon 0.1 --ratio_lower_start 0.6 --ratio_lower_max 0.9 --ratio_lower_step 0.02 --ratio_upper_start 1.2 "
     "--ratio_upper_max 3.0 --ratio_upper_step 0.05", "epsilon=0.1 has no effect: the six ratio_* fields you set"),
    ("--max_staleness 2", "`max_staleness` (2) only acts on async generation, and `async_generation` is off"),
    ("--async_generation --use_vllm --vllm_mode server --lazy_weight_loading",
     "`lazy_weight_loading` has no effect with `max_staleness`=1"),
]


@pytest.mark.parametrize("flags,expected", ERRORS, ids=[e[0] for e in ERRORS])
def test_setting_that_can_never_act_is_refused(flags, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for part in expected:
        assert part in err


@pytest.mark.parametrize("flags,expected", WARNINGS, ids=[w[0] for w in WARNINGS])
def test_useless_setting_warns(flags, expected):
    with pytest.warns(UserWarning) as record:
        parse_args(flags.split())
    assert any(expected in str(w.message) for w in record), [str(w.message) for w in record]


def test_the_default_job_needs_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        parse_args([])


def test_the_table_has_the_rows_the_readme_promises():
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page.split("## Settings that would do nothing")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # minus the header
    assert len(rows) == len(ERRORS) + len(WARNINGS) >= 8


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_train_bapo_refuses_replay_that_would_evict_everything(tmp_path):
    """The measured case: with the default steps_per_generation=8 this replay setting used to log replay/* metrics
    while evicting every group before it could be replayed."""
    proc = subprocess.run(
        [sys.executable, "train_bapo.py", "--replay_buffer_size", "32", "--replay_ratio", "0.5",
         "--replay_max_staleness", "8", "--output_dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert "Set `replay_max_staleness` >= 15" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "checkpoint-1").exists()
