"""Partial rollout: the pool's bookkeeping, and BAPOTrainer training on completions that span several steps."""

import copy
import math

import pytest
from transformers import AutoModelForCausalLM

from bapo_trl.rollout import PartialRollout
from bapo_trl.rollout.pool import PartialRolloutPool
from support.harness import PolicySnapshots, check_behaviour_logps, cpu_config, source_of, tiny_trainer
from support.partial_rollouts import RECORDING, segment_logps_match_saved_policies

EOS = 99


def scripted_generate(length_of):
    """Test double for the model's generate: prompt k always continues with tokens 1, 2, 3, ... up to
    `length_of[k]` tokens in total, then EOS (named as a stand-in; the trainer tests below use the real model)."""

    def generate(prefixes, max_new):
        out = []
        for prefix in prefixes:
            key, done = prefix[0], len(prefix) - 1
            total = length_of[key]
            tokens = list(range(done + 1, min(total, done + max_new) + 1))
            if done + len(tokens) == total and len(tokens) < max_new:
                tokens.append(EOS)
            out.append(tokens)
        return out, None  # no sampler log-probs, like transformers generate

    return generate


def scripted_score(prefixes, segments):
    return [[-0.5] * len(s) for s in segments]


def test_pool_grows_by_budget_finishes_and_pops_oldest_first():
    pool = PartialRolloutPool(budget=2, max_resumes=3, max_completion_length=20, eos_token_ids=[EOS])
    gen = scripted_generate({0: 1, 1: 5, 2: 3})
    pool.add_groups([{"id": 0}, {"id": 1}], [[0], [1]], group_size=1)
    pool.add_groups([{"id": 2}], [[2]], group_size=1)
    pool.grow(gen, scripted_score, step=0)  # 0: [1, EOS] done; 1: [1, 2]; 2: [1, 2]
    assert pool.num_ready() == 1 and pool.end_step() == 2
    pool.grow(gen, scripted_score, step=1)  # 1: [1..4]; 2: [1, 2, 3, EOS] done
    assert [g.rows[0]["id"] for g in pool.pop_ready(5)] == [0, 2]
    (left,) = pool.groups
    c = left.completions[0]
    assert c.token_ids == [1, 2, 3, 4] and c.versions == [0, 0, 1, 1] and c.segments == 2 and c.resumes == 1


def test_finish_completes_the_oldest_groups_and_overdue_completions():
    pool = PartialRolloutPool(budget=1, max_resumes=2, max_completion_length=6, eos_token_ids=[EOS])
    gen = scripted_generate({0: 9, 1: 4, 2: 4})
    pool.add_groups([{"id": k} for k in range(3)], [[0], [1], [2]], group_size=1)
    pool.grow(gen, scripted_score, step=0)
    pool.finish(gen, scripted_score, step=0, num_groups=1)  # only group 0 is finished now
    first = pool.groups[0].completions[0]
    assert first.finished and len(first.token_ids) == 6  # stopped by max_completion_length, no EOS
    for _ in range(2):
        pool.end_step()
    pool.finish(gen, scripted_score, step=2, num_groups=0)  # resumes >= 2: generated to the end
    assert pool.num_ready() == 3



def test_a_completion_that_stops_short_of_its_cap_is_finished_and_longer_answers_are_cut():
    """A generator may stop on a token the pool does not know as EOS (a stop token of its own config): fewer tokens
    than asked means it ended. A generator that answers with MORE than the cap (one server request for several
    ranks uses the largest rank's cap) is cut back to this pool's cap."""
    pool = PartialRolloutPool(budget=3, max_resumes=5, max_completion_length=20, eos_token_ids=[EOS])
    answers = {0: [7, 8], 1: [1, 2, 3, 4, 5, 6], 2: [4, 5, 6]}  # 0 stops short without EOS; 1 overshoots the cap

    def generate(prefixes, max_new):
        return [answers[p[0]] for p in prefixes], None

    pool.add_groups([{"id": k} for k in range(3)], [[0], [1], [2]], group_size=1)
    pool.grow(generate, scripted_score, step=0)
    short, long, exact = (g.completions[0] for g in pool.groups)
    assert short.finished and short.token_ids == [7, 8]
    assert not long.finished and long.token_ids == [1, 2, 3] and len(long.logps) == 3
    assert not exact.finished and exact.token_ids == [4, 5, 6]

def test_pool_state_round_trip():
    pool = PartialRolloutPool(budget=2, max_resumes=3, max_completion_length=20, eos_token_ids=[EOS])
    pool.add_groups([{"id": 1}], [[1]], group_size=1)
    pool.grow(scripted_generate({1: 7}), scripted_score, step=3)
    other = PartialRolloutPool(budget=2, max_resumes=3, max_completion_length=20, eos_token_ids=[EOS])
    other.load_state_dict(copy.deepcopy(pool.state_dict()))
    assert vars(other.groups[0].completions[0]) == vars(pool.groups[0].completions[0])


@pytest.mark.parametrize("new_cap", [20, 7, 4, 3])
def test_a_resume_with_a_shorter_max_completion_length_cuts_the_pool_there(new_cap):
    """A pool saved with max_completion_length 20 (a finished completion of 6 tokens + EOS, an unfinished one of 4)
    and restored under a shorter cap: every completion at or past it is cut there (tokens, log-probs, sampler
    log-probs, versions alike) and finished, as TRL truncates; the rest are untouched. The unfinished one at exactly
    the cap asked for a negative number of tokens before; a finished one past it was trained longer than the cap."""
    from transformers.testing_utils import CaptureLogger

    from bapo_trl.rollout import pool as pool_module

    pool = PartialRolloutPool(budget=4, max_resumes=3, max_completion_length=20, eos_token_ids=[EOS])
    pool.add_groups([{"id": 0}, {"id": 1}], [[0], [1]], group_size=1)
    pool.grow(scripted_generate({0: 6, 1: 9}), scripted_score, step=0)
    pool.grow(scripted_generate({0: 6, 1: 9}), scripted_score, step=1)
    for c in (g.completions[0] for g in pool.groups):
        c.sampling_logps = [-0.25] * len(c.token_ids)
    saved = copy.deepcopy(pool.state_dict())
    done, growing = (vars(g.completions[0]).copy() for g in pool.groups)
    assert (len(done["token_ids"]), done["finished"], len(growing["token_ids"]), growing["finished"]) == (7, True, 8,
                                                                                                         False)
    other = PartialRolloutPool(budget=4, max_resumes=3, max_completion_length=new_cap, eos_token_ids=[EOS])
    with CaptureLogger(pool_module.logger) as log:
        other.load_state_dict(saved)
    cut = 0
    for before, after in zip((done, growing), (g.completions[0] for g in other.groups)):
        keep = min(len(before["token_ids"]), new_cap)
        cut += keep < len(before["token_ids"]) or (keep == new_cap and not before["finished"])
        for name in ("token_ids", "logps", "sampling_logps", "versions"):
            assert getattr(after, name) == before[name][:keep], name
        assert after.finished == (before["finished"] or keep == new_cap)
    assert (f"{cut} completion(s) of the partial-rollout pool reached" in log.out) == (cut > 0), log.out
    other.grow(scripted_generate({0: 6, 1: 9}), scripted_score, step=2)  # grows what is left, within the cap
    assert all(len(c.token_ids) <= new_cap for g in other.groups for c in g.completions)


def test_stop_token_ids_from_generation_kwargs_end_completions(tiny_model_dir, tmp_path):
    """A stop token given through generation_kwargs ends a completion for the pool too (else a stop exactly at the
    cap would look like a capped completion and be grown past its end)."""
    trainer = build(tiny_model_dir, tmp_path, generation_kwargs={"eos_token_id": [1, 7]})
    assert ({1, 7} <= set(source_of(trainer, PartialRollout).pool.eos)
            and set(trainer.eos_token_ids) <= set(source_of(trainer, PartialRollout).pool.eos))
    pool = PartialRolloutPool(budget=3, max_resumes=5, max_completion_length=20,
                              eos_token_ids=source_of(trainer, PartialRollout).pool.eos)
    pool.add_groups([{"id": 0}], [[0]], group_size=1)
    pool.grow(lambda prefixes, n: ([[5, 6, 7]], None), scripted_score, step=0)  # stops on 7, exactly at the cap
    assert pool.groups[0].finished


ARGS = dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=10, logging_steps=1,
            learning_rate=2e-3, seed=1, partial_rollout_budget=3, partial_rollout_max_resumes=3,
            lr_scheduler_type="constant")


def build(model_dir, out, callbacks=(), probe=None, **overrides):
    return tiny_trainer(model_dir, cpu_config(out, **{**ARGS, **overrides}), prompts=256,
                        callbacks=callbacks, **(probe or {}))


@pytest.fixture(scope="module")
def partial_run(tiny_model_dir, tmp_path_factory):
    snapshots = PolicySnapshots()
    trainer = build(tiny_model_dir, tmp_path_factory.mktemp("partial"), [snapshots], RECORDING,
                    max_steps=6, save_strategy="no")
    trainer.train()
    return trainer, snapshots


def test_completions_span_several_steps_and_training_is_finite(partial_run):
    trainer, _ = partial_run
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert max(h["partial/segments_per_completion"] for h in logs) > 1.5
    assert max(h["partial/carried"] for h in logs) > 0
    assert max(h["bapo/staleness_max"] for h in logs) >= 1  # early segments come from an older policy
    multi = [c for c in trainer.trained if c.segments > 1]
    assert multi, "no completion spanned two steps"
    for c in trainer.trained:
        assert len(c.logps) == len(c.token_ids) == len(c.versions) and c.versions == sorted(c.versions)


def test_dynamics_plot_shows_the_partial_rollout_panel(partial_run):
    from bapo_trl.reporting.dynamics import plot_dynamics

    trainer, _ = partial_run
    fig = plot_dynamics(trainer.state.log_history)
    assert "partial_rollout" in fig.bapo_panels
    drawn = {line.get_gid() for line in fig.bapo_axes["partial_rollout"].lines if line.get_gid()}
    assert drawn == {"partial/segments_per_completion", "partial/resumes_mean"}


def test_each_segment_carries_the_logps_of_the_policy_that_produced_it(partial_run, tiny_model_dir):
    trainer, snapshots = partial_run
    checked, gap = segment_logps_match_saved_policies(trainer.trained, snapshots, tiny_model_dir, trainer.temperature)
    assert len(checked) >= 2 and gap > 1e-3


def test_a_completion_paused_across_two_updates_keeps_every_segments_version_and_log_probs(tiny_model_dir, tmp_path):
    """The guarantee row "versions never silently mixed": a completion whose tokens come from three policies (paused
    across two optimizer steps) carries, token by token, the version that generated it and that version's log-prob
    (recomputed with the saved policies), and the logged staleness counts per token (step - version of each token,
    averaged over the batch's tokens, not one version per completion)."""
    snapshots = PolicySnapshots()
    # groups of 2 (both right: finished in their first round, so the pool need not finish older groups to fill a
    # batch) and a budget of 4 (a right answer, 3 digits and EOS, ends in one round; a rambling one is carried)
    trainer = build(tiny_model_dir, tmp_path, [snapshots], RECORDING, max_steps=8, save_strategy="no",
                    num_generations=2, learning_rate=5e-3, partial_rollout_budget=4, partial_rollout_max_resumes=5,
                    max_completion_length=12)
    trainer.train()
    spanning = [c for c in trainer.trained if len(set(c.versions)) >= 3]
    assert spanning, "no completion was paused across two updates"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for c in spanning[:6]:
        check_behaviour_logps(model, snapshots.policies, c.prompt_ids, c.token_ids, c.versions, c.logps, atol=1e-4,
                              temperature=trainer.temperature, newest=max(c.versions))
    batch = trainer.args.per_device_train_batch_size
    logged = [h["partial/token_staleness_mean"] for h in trainer.state.log_history if "partial/carried" in h]
    assert len(trainer.trained) == batch * len(logged)
    for step, value in enumerate(logged):
        ages = [step - v for c in trainer.trained[step * batch:(step + 1) * batch] for v in c.versions]
        assert value == pytest.approx(sum(ages) / len(ages)), step
    assert any(v > 0 for v in logged)


def test_lora_segments_carry_the_logps_of_the_adapted_policy(tiny_model_dir, tmp_path):
    """With a peft LoRA adapter, each segment's log-probs are those of base + adapter at that step (the snapshots
    hold the adapter weights, which change every step)."""
    from peft import LoraConfig, get_peft_model

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    snapshots = PolicySnapshots()
    trainer = build(tiny_model_dir, tmp_path, [snapshots], dict(RECORDING, peft_config=LoraConfig(**lora)),
                    max_steps=4, learning_rate=2e-2)
    trainer.train()
    assert any("lora_B" in k for k in snapshots.policies[0])
    checked, gap = segment_logps_match_saved_policies(trainer.trained, snapshots, None, trainer.temperature,
                                                      model=get_peft_model(AutoModelForCausalLM.from_pretrained(
                                                          tiny_model_dir), LoraConfig(**lora)))
    assert len(checked) >= 2 and gap > 1e-3  # the adapter moved between segments, and each kept its own log-probs


def test_trl_old_logps_are_the_stored_segment_logps(tiny_model_dir, tmp_path):
    """With steps_per_generation > gradient_accumulation_steps TRL computes old_per_token_logps itself (one forward
    of the current policy); the trainer answers that call with the stored per-segment log-probs instead."""
    batches = []

    def record_batch(trainer, next_batch, inputs, score):  # each batch with the completions scored for it
        output = next_batch(inputs, score)
        batches.append((output, list(trainer.trained[-output["completion_ids"].size(0):])))
        return output

    probe = dict(RECORDING, around={**RECORDING["around"], (PartialRollout, "next_batch"): record_batch})
    trainer = build(tiny_model_dir, tmp_path, probe=probe, max_steps=4, save_strategy="no", steps_per_generation=2,
                    per_device_train_batch_size=8)
    trainer.train()
    assert len(batches) == 2 and all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    for output, completions in batches:
        old = output["old_per_token_logps"]
        for row, c in enumerate(completions):
            assert old[row, : len(c.logps)].tolist() == pytest.approx(c.logps, abs=1e-6)
    assert max(h.get("partial/token_staleness_max", 0) for h in trainer.state.log_history) >= 1


def test_resume_keeps_carried_completions(tiny_model_dir, tmp_path):
    common = dict(max_steps=6, save_strategy="steps", save_steps=3)
    full = build(tiny_model_dir, tmp_path / "full", **common)
    full.train()
    ran = PolicySnapshots()  # records the steps this process really ran
    resumed = build(tiny_model_dir, tmp_path / "resumed", [ran], **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    a, b = source_of(full, PartialRollout).pool.groups, source_of(resumed, PartialRollout).pool.groups
    assert len(a) == len(b) > 0
    # a resume, not a fresh run: it trained steps 4-6 only, and drew its top-up prompts where the full run was
    assert sorted(ran.policies) == [3, 4, 5]
    assert (source_of(resumed, PartialRollout).pool.extra_prompts_used
            == source_of(full, PartialRollout).pool.extra_prompts_used > 0)
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga.completions, gb.completions):
            assert ca.token_ids == cb.token_ids and ca.versions == cb.versions
            assert ca.logps == pytest.approx(cb.logps, abs=1e-5)


def test_partial_rollout_from_train_bapo(tmp_path, monkeypatch):
    """The flags work end to end from the script (embedded model and task)."""
    import json

    from bapo_trl.cli.train import make_parser, run

    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    run(["--partial_rollout_budget", "3", "--partial_rollout_max_resumes", "2", "--max_steps", "3",
         "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "1",
         "--max_completion_length", "10", "--output_dir", str(out)], parser=make_parser())
    logs = json.loads((out / "bapo_log_history.json").read_text())["log_history"]
    steps = [h for h in logs if "loss" in h]
    assert len(steps) == 3 and all("partial/carried" in h for h in steps)
    assert max(h["partial/segments_per_completion"] for h in steps) > 1
