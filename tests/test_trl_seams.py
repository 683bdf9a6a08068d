"""The TRL seam check: every private TRL method/attribute bapo_trl builds on is present, and a missing or changed
one stops the import with a message naming it and the tested TRL versions."""

import subprocess
import sys

import pytest
from trl import GRPOTrainer

from bapo_trl.trl_seams import SEAMS, TESTED_TRL_VERSIONS, check_trl_seams, seam_problems


def test_the_installed_trl_has_every_seam():
    assert seam_problems() == []


def test_a_removed_method_is_named(monkeypatch):
    monkeypatch.delattr(GRPOTrainer, "_generate_single_turn")
    with pytest.raises(ImportError) as err:
        check_trl_seams()
    assert "GRPOTrainer._generate_single_turn is missing" in str(err.value)
    assert TESTED_TRL_VERSIONS in str(err.value) and "pip install 'trl>=1.16,<1.17'" in str(err.value)


def test_a_changed_signature_is_named(monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", lambda self, model, batch: None)
    problems = seam_problems()
    assert len(problems) == 1 and "_get_per_token_logps_and_entropies takes ['model', 'batch']" in problems[0]


def test_a_loss_that_stopped_reading_epsilon_is_named(monkeypatch):
    def _compute_loss(self, model, inputs):  # clips with something else: our window would be ignored
        return self.clip_range

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", _compute_loss)
    problems = seam_problems()
    assert len(problems) == 1 and "self.epsilon_low" in problems[0] and "_compute_loss" in problems[0]


def test_each_seam_is_listed_once():
    assert len({s.target for s in SEAMS}) == len(SEAMS)


def test_importing_the_trainer_fails_loudly_when_a_seam_is_gone():
    code = ("import trl.trainer.grpo_trainer as g; del g.GRPOTrainer._generate_and_score_completions; "
            "import bapo_trl.trainer")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ImportError: bapo_trl was tested with TRL" in proc.stderr
    assert "_generate_and_score_completions is missing" in proc.stderr
