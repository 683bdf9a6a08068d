"""Replay inside BAPOTrainer: behaviour log-probs, staleness, checkpoint round trip."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from bapo_trl import BAPOTrainer
from bapo_trl.core import metrics
from bapo_trl.recipes.toy import reverse_reward
from bapo_trl.rollout import ReplaySource
from support.harness import PolicySnapshots, Probe, check_behaviour_logps, cpu_config, replay_queue_of, tiny_trainer

REPLAY = dict(
    per_device_train_batch_size=16, num_generations=4, max_completion_length=10, logging_steps=1, seed=0,
    learning_rate=5e-3, steps_per_generation=1, replay_buffer_size=32, replay_ratio=0.5, replay_max_staleness=3,
    lr_scheduler_type="constant",
)


def record_search(trainer, choose_window, logps, inputs, mask, ratio, *args):
    """Records, per loss call, the ratios and origin flags the search saw (around the real _choose_window)."""
    trainer.seen.append((ratio.detach().clone(), inputs["replayed"].clone(), mask.clone()))
    return choose_window(logps, inputs, mask, ratio, *args)


def record_pushed(trainer, push, group):
    """Keeps every group the queue stored, for the checks (around the real push)."""
    stored = push(group)
    if stored:
        trainer.pushed.append(replay_queue_of(trainer).groups[-1])
    return stored


def build(cls, model_dir, out, callbacks=(), reward=reverse_reward, around=None, record=(), **overrides):
    probe = dict(around=around, record=record) if cls is Probe else {}
    return tiny_trainer(model_dir, cpu_config(out, **{**REPLAY, **overrides}), cls=cls, reward=reward,
                        prompts=512, prompt_seed=0, callbacks=callbacks, **probe)


@pytest.fixture(scope="module")
def replay_run(tiny_model_dir, tmp_path_factory):
    snapshots = PolicySnapshots()
    trainer = build(Probe, tiny_model_dir, tmp_path_factory.mktemp("replay"), [snapshots],
                    around={"_choose_window": record_search, (ReplaySource, "queue.push"): record_pushed},
                    record=("seen", "pushed"), max_steps=8, save_strategy="no", replay_sampling="recent")
    trainer.train()
    return trainer, snapshots


def test_replayed_tokens_use_stored_behaviour_logps(replay_run):
    trainer, _ = replay_run
    fresh_dev, replayed_dev = [], []
    for ratio, replayed, mask in trainer.seen:
        valid = mask.bool()
        fresh_dev.append((ratio - 1).abs()[valid & ~replayed[:, None]])
        replayed_dev.append((ratio - 1).abs()[valid & replayed[:, None]])
    fresh_dev, replayed_dev = torch.cat(fresh_dev), torch.cat(replayed_dev)
    assert replayed_dev.numel() > 0, "nothing was replayed"
    assert fresh_dev.max() < 1e-4  # on-policy fresh data: ratio 1 up to float noise
    assert replayed_dev.mean() > 1e-3  # replayed data is off-policy: the policy moved since sampling


def test_stored_logps_are_those_of_the_sampling_policy(replay_run, tiny_model_dir):
    trainer, snapshots = replay_run
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    checked = 0
    for group in trainer.pushed:
        version = int(group["policy_version"][0])
        check_behaviour_logps(model, snapshots.policies, group["prompt_ids"], group["completion_ids"], version,
                              group["old_per_token_logps"], atol=1e-4,
                              attention_mask=torch.cat([group["prompt_mask"], group["completion_mask"]], 1),
                              mask=group["completion_mask"])
        checked += 1
    assert checked >= 8 and len({int(g['policy_version'][0]) for g in trainer.pushed}) >= 3


def test_staleness_and_replay_metrics(replay_run):
    trainer, _ = replay_run
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for name in metrics.REPLAY:
        assert any(name in h for h in logs), name
    for h in logs:
        assert h["replay/size"] <= 32
        if h.get("replay/staleness_max") is not None:
            assert h["replay/staleness_max"] <= 3
    # scripted expectation: "recent" sampling replays the 2 newest stored groups still within 3 steps
    versions = sorted(int(g["policy_version"][0]) for g in trainer.pushed)
    replayed_steps = [h for h in logs if h.get("replay/fraction", 0) > 0]
    assert len(replayed_steps) >= 4
    for h in logs:
        step = h["step"] - 1  # global_step while the batch was trained
        eligible = [v for v in versions if v < step and step - v <= 3]
        expected = sorted(eligible)[-2:]
        if not expected:
            assert h.get("replay/fraction", 0) == 0.0
            continue
        assert h["replay/staleness_max"] == step - min(expected), h["step"]
        assert step - max(expected) <= h["replay/staleness_mean"] <= step - min(expected)
        assert h["replay/fraction"] == pytest.approx(len(expected) / 4)
    assert logs[0].get("replay/fraction") == 0.0  # the queue starts empty
    assert all(math.isfinite(h["loss"]) for h in logs)


class StepsRun(TrainerCallback):
    """Records the optimizer steps this trainer object ran itself (not the ones it loaded from a checkpoint)."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def test_resume_restores_the_queue_and_continues_identically(tiny_model_dir, tmp_path):
    import hashlib

    common = dict(max_steps=8, save_strategy="steps", save_steps=4, replay_sampling="uniform", seed=3,
                  learning_rate=1e-3, replay_max_staleness=6)
    full = build(BAPOTrainer, tiny_model_dir, tmp_path / "full", **common)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-4"
    files = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in checkpoint.iterdir()}  # noqa: E731
    before = files()
    steps_run = StepsRun()
    resumed = build(BAPOTrainer, tiny_model_dir, tmp_path / "resumed", [steps_run], **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # CPU runs are deterministic: a fresh run with the same seed would log the same history. This one started from
    # the checkpoint: it ran steps 5-8 only, and left the checkpoint as it was.
    assert steps_run.steps == [5, 6, 7, 8]
    assert files() == before
    a, b = replay_queue_of(full), replay_queue_of(resumed)
    assert len(a) == len(b) > 0
    for ga, gb in zip(a.groups, b.groups):
        assert ga.keys() == gb.keys()
        for key in ga:
            assert torch.allclose(ga[key].float(), gb[key].float(), atol=1e-6), key
    # the steps after the checkpoint log the same metrics
    after = lambda t: [h for h in t.state.log_history if "loss" in h and h["step"] > 4]  # noqa: E731
    assert [h["step"] for h in after(full)] == [h["step"] for h in after(resumed)] == [5, 6, 7, 8]
    for ha, hb in zip(after(full), after(resumed)):
        for key in ("loss", "reward", "replay/size", "replay/fraction", "bapo/clip_high",
                    "bapo/positive_contribution"):
            if key in ha:
                assert ha[key] == pytest.approx(hb[key], abs=1e-5, nan_ok=True), (ha["step"], key)


def test_missing_queue_file_in_checkpoint_is_a_clear_error(tiny_model_dir, tmp_path):
    first = build(BAPOTrainer, tiny_model_dir, tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    (tmp_path / "a" / "checkpoint-2" / "replay_queue_rank0.pt").unlink()
    second = build(BAPOTrainer, tiny_model_dir, tmp_path / "b", max_steps=4)
    with pytest.raises(FileNotFoundError, match="replay_queue_rank0.pt"):
        second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))


def flat_for_even_digits(prompts, completions, answer, completion_ids=None, **kwargs):
    """The toy reward, but 0 for every completion of a prompt starting with an even digit: those groups have no
    reward spread, so the batches always hold some groups without learning signal."""
    scores = reverse_reward(completions, answer, completion_ids=completion_ids)
    return [0.0 if str(p).lstrip()[:1] in "02468" else s for p, s in zip(prompts, scores)]


def record_fill(trainer, mix, output, *args, **kwargs):
    """Records, for each generation batch, the fresh groups without spread, what was asked of and given by the queue,
    and the groups without spread that stayed in the trained batch (around the real mix and queue sampling)."""
    groups = output["advantages"].view(-1, trainer.num_generations)
    flat_fresh = int((groups.max(1).values == groups.min(1).values).sum())
    queue = replay_queue_of(trainer)
    sample, asked = queue.sample, []

    def recording_sample(num_groups, current_step):
        got = sample(num_groups, current_step)
        asked.append((num_groups, len(got)))
        return got

    queue.sample = recording_sample
    try:
        mixed = mix(output, *args, **kwargs)
    finally:
        queue.sample = sample
    adv, replayed = (mixed["advantages"].view(-1, trainer.num_generations),
                     mixed["replayed"].view(-1, trainer.num_generations))
    flat_kept = int(((adv.max(1).values == adv.min(1).values) & ~replayed[:, 0]).sum())
    trainer.fill_log.append(dict(flat_fresh=flat_fresh, asked=asked[0][0], given=asked[0][1], flat_kept=flat_kept,
                                 rows=mixed["advantages"].numel()))
    return mixed


def test_fill_zero_std_groups_replaces_groups_without_spread_first(tiny_model_dir, tmp_path):
    trainer = build(Probe, tiny_model_dir, tmp_path, reward=flat_for_even_digits, max_steps=6,
                    around={(ReplaySource, "mix"): record_fill}, record=("fill_log",),
                    save_strategy="no", replay_ratio=0.25, replay_fill_zero_std_groups=True, replay_max_staleness=4)
    trainer.train()
    log = trainer.fill_log
    assert len(log) == 6 and all(b["rows"] == 16 for b in log)  # 4 groups per batch, always
    for b in log:
        assert b["asked"] == max(1, b["flat_fresh"])  # replay_ratio's 1 group, or one per group without spread
        assert b["flat_kept"] == max(0, b["flat_fresh"] - b["given"])  # those are the first to give up their place
    assert any(b["given"] >= 2 and b["flat_fresh"] >= 2 for b in log), log  # more than replay_ratio asks for
    assert all(bool(g["advantages"].max() > g["advantages"].min()) for g in replay_queue_of(trainer).groups)


def test_replay_staleness_is_counted_at_the_last_update_on_the_batch(tiny_model_dir, tmp_path):
    """Each generation batch trains 2 updates: a group is sampled only if it is still within replay_max_staleness
    at the second one, so no replayed token ever trains past the limit (it would reach 5 counted at the first)."""
    trainer = build(BAPOTrainer, tiny_model_dir, tmp_path, max_steps=10, save_strategy="no", steps_per_generation=2,
                    per_device_train_batch_size=8, replay_ratio=0.5, replay_max_staleness=4,
                    replay_sampling="uniform")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    ages = [h["replay/staleness_max"] for h in logs if h.get("replay/staleness_max") is not None]
    assert ages and max(ages) == 3, ages  # pushed at s, replayed at s + 2 and s + 3; evicted before s + 4
    assert all(h["bapo/staleness_max"] <= 4 for h in logs)


def record_generated(trainer, generate, prompts):
    """Records how many prompts each generation call really generated for (around TRL's _generate)."""
    trainer.generated.append(len(prompts))
    return generate(prompts)


def record_batch_rows(trainer, mix, output, appended=0):
    """Records the rows of each batch replay hands to training (around the real mix)."""
    mixed = mix(output, appended)
    trainer.batch_rows.append(mixed["completion_ids"].size(0))
    return mixed


COUNT_GENERATION = dict(around={"_generate": record_generated, (ReplaySource, "mix"): record_batch_rows},
                        record=("generated", "batch_rows"))


def test_replay_that_saves_generation_generates_only_the_fresh_share(tiny_model_dir, tmp_path):
    """4 groups of 4 per batch, replay_ratio 0.5: once the queue holds 2 groups, each batch generates 2 groups (8
    completions) and replays 2; the batch handed to training keeps its 16 rows. While the queue is short: full."""
    trainer = build(Probe, tiny_model_dir, tmp_path, max_steps=8, save_strategy="no", replay_saves_generation=True,
                    **COUNT_GENERATION)
    trainer.train()
    assert trainer.generated[0] == 16  # empty queue: full generation
    assert 8 in trainer.generated and set(trainer.generated) <= {8, 16}
    assert trainer.batch_rows == [16] * len(trainer.batch_rows)
    saved = [h["replay/generation_saved"] for h in trainer.state.log_history if "replay/generation_saved" in h]
    assert saved[0] == 0.0 and [g == 8 for g in trainer.generated] == [s == 0.5 for s in saved]
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    baseline = build(Probe, tiny_model_dir, tmp_path / "full", max_steps=8, save_strategy="no", **COUNT_GENERATION)
    baseline.train()
    assert baseline.generated == [16] * 8  # without the option every batch is generated in full
