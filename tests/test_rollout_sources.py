"""The rollout-source contract: a new source is one file plus one registration line, and the trainer trains from it.

``FixedCompletions`` below is such a source, written as a user would: it answers every prompt with completions from
a list, through the port only (it never sees the trainer), and keeps a counter as its checkpointed state. It is
registered with one line and selected with ``BAPOConfig(rollout_source="fixed")``; nothing else in the package
knows about it. It stands in for a generator on purpose (fixed text makes the batches checkable), and it is the real
contract that is exercised: TRL scores its completions, BAPO's search sees their behaviour log-probs, replay wraps it,
checkpoints save and restore its state.
"""

from __future__ import annotations

import math

import pytest
import torch

from bapo_trl import BAPOTrainer
from bapo_trl.recipes.toy import build_tokenizer
from bapo_trl.rollout import ReadyCompletions, ReplaySource, register_source
from bapo_trl.rollout.contract import NothingInBackground, RolloutSource, TrainerPort, stamp_policy_version
from support.harness import Probe, cpu_config, tiny_trainer

#: The completions, as text; each is followed by EOS. Two right answers' shapes and two wrong ones of other lengths.
TEXTS = ("321", "12", "99999", "1")
#: The embedded model's tokenizer (the tiny model directory holds the same one).
TOKENIZER = build_tokenizer()
#: Every token of a fixed completion is "sampled" with this log-prob (its policy gave it probability e^-1).
BEHAVIOUR_LOGP = -1.0


class FixedCompletions(NothingInBackground):
    """A rollout source: the i-th completion of every group is ``TEXTS[i % len(TEXTS)]``."""

    state_name = "fixed_completions"

    def __init__(self, port: TrainerPort):
        self.port = port
        self.batches = 0  # batches made (checkpointed)

    def next_batch(self, inputs, score):
        port, eos = self.port, TOKENIZER.eos_token_id
        completions = [TOKENIZER(TEXTS[i % len(TEXTS)], add_special_tokens=False).input_ids + [eos]
                       for i in range(len(inputs))]
        logps = [[BEHAVIOUR_LOGP] * len(c) for c in completions]
        ready = ReadyCompletions(port.tokenize_prompts([row["prompt"] for row in inputs]), completions, logps, logps)
        self.batches += 1
        return stamp_policy_version(port.score_completions(score, inputs, ready), port.global_step)

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


register_source("fixed", FixedCompletions)  # the one registration line


def length_reward(completions, **kwargs) -> list[float]:
    """Spread inside every group (the fixed completions have different lengths), so every group has a signal."""
    return [float(len(c)) for c in completions]


def record_batch(trainer, next_batch, inputs, score):
    """Keeps every batch the source hands to TRL's training loop (around the real source's next_batch)."""
    output = next_batch(inputs, score)
    trainer.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in output.items()})
    return output


def build(tiny_model_dir, tmp_path, cls=Probe, **overrides):
    """``cls``: a :class:`support.harness.Probe` keeping every batch (``batches``), or BAPOTrainer."""
    settings = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                    seed=0, max_steps=4, learning_rate=1e-3, steps_per_generation=2, save_strategy="no",
                    rollout_source="fixed")
    probe = dict(around={"rollout_source.next_batch": record_batch}, record=("batches",)) if cls is Probe else {}
    return tiny_trainer(tiny_model_dir, cpu_config(tmp_path / "out", **{**settings, **overrides}), cls=cls,
                        reward=length_reward, prompts=64, prompt_seed=0, **probe)


def test_the_trainer_trains_from_a_source_registered_in_one_line(tiny_model_dir, tmp_path):
    trainer = build(tiny_model_dir, tmp_path)
    assert isinstance(trainer.rollout_source, FixedCompletions) and isinstance(trainer.rollout_source, RolloutSource)
    trainer.train()
    tokenizer = trainer.processing_class
    assert len(trainer.batches) == 2  # 4 steps, 2 per generation batch
    for batch in trainer.batches:
        lengths = batch["completion_mask"].sum(1).long().tolist()
        texts = [tokenizer.decode(ids[: n - 1]) for ids, n in zip(batch["completion_ids"].tolist(), lengths)]
        assert texts == [TEXTS[i % len(TEXTS)] for i in range(len(texts))]
        # TRL's old-logp forward was answered with the source's behaviour log-probs, and it scored the completions
        real = batch["completion_mask"].bool()
        assert torch.all(batch["old_per_token_logps"][real] == BEHAVIOUR_LOGP)
        assert batch["advantages"].abs().sum() > 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(math.isfinite(h["loss"]) for h in logs)
    # every ratio is far from 1 (the real policy vs e^-1 per token): the search acted on every update
    assert all(h["bapo/search_active"] == 1.0 for h in logs)
    assert trainer.rollout_source.batches == 2


def test_replay_wraps_a_registered_source(tiny_model_dir, tmp_path):
    trainer = build(tiny_model_dir, tmp_path, replay_buffer_size=8, replay_ratio=0.5, max_steps=6)
    assert isinstance(trainer.rollout_source, ReplaySource) and isinstance(trainer.rollout_source.inner,
                                                                           FixedCompletions)
    trainer.train()
    replayed = [float(b["replayed"].float().mean()) for b in trainer.batches]
    assert replayed[0] == 0.0 and replayed[-1] == 0.5  # the queue fills, then half of each batch is replayed


def test_a_sources_state_is_checkpointed_and_restored(tiny_model_dir, tmp_path):
    trainer = build(tiny_model_dir, tmp_path, save_strategy="steps", save_steps=2, cls=BAPOTrainer)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert torch.load(checkpoint / "fixed_completions_rank0.pt") == {"batches": 1}
    resumed = build(tiny_model_dir, tmp_path / "again", cls=BAPOTrainer)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.rollout_source.batches == 2  # 1 restored + 1 made after the resume


def test_an_unknown_source_is_refused_with_the_registered_names(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"`rollout_source` 'nope' is not a registered rollout source; registered: "
                                         r"\[.*'fixed'.*'trl'.*\]"):
        build(tiny_model_dir, tmp_path, rollout_source="nope")


def test_register_source_refuses_auto():
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_source("auto", FixedCompletions)
