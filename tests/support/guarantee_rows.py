"""The off-policy guarantee rows of test_guarantees.py: the table of rollout sources (and the row sets that change
how a row runs or is checked), :func:`run_row`, which trains one row and checks its guarantees, and the builders and
checks it uses, shared with the tests that run a row, or parts of one, elsewhere."""

from __future__ import annotations

import contextlib
import math
import shutil
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from bapo_trl import BAPOConfig
from bapo_trl.core.numerics import loss_mask
from bapo_trl.rollout.producer import Producer
from bapo_trl.rollout.settings import staleness_bound
from bapo_trl.trainer.trl_port import TRLPort
from support.harness import PolicySnapshots, Probe, cpu_config, probe_of, replay_queue_of, tiny_trainer
from support.harness import check_behaviour_logps as behaviour_logps_match
from support.policy_server import PolicyServer

#: Evaluation at every step (TRL's own generation, on the current policy), on a 2-prompt eval set.
EVALUATING = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
SOURCES = {
    "trl": {},
    "replay": dict(replay_buffer_size=8, replay_ratio=0.5),
    "partial": dict(partial_rollout_budget=3, partial_rollout_max_resumes=2),
    "async_k1": dict(async_generation=True, max_staleness=1),
    "async_k1_held_push": dict(async_generation=True, max_staleness=1),
    "async_partial_held_push": dict(async_generation=True, partial_rollout_budget=3, partial_rollout_max_resumes=2),
    "async_k2": dict(async_generation=True, max_staleness=2),
    "async_partial": dict(async_generation=True, partial_rollout_budget=3, partial_rollout_max_resumes=2),
    "replay_async": dict(async_generation=True, replay_buffer_size=8, replay_ratio=0.5),
    "async_inflight": dict(async_generation=True, max_staleness=2, inflight_update_tokens=2),
    "replay_saves_async": dict(async_generation=True, max_staleness=2, replay_buffer_size=8, replay_ratio=0.5,
                               replay_saves_generation=True),
    "async_k2_two_servers": dict(async_generation=True, max_staleness=2),
    "async_k2_lazy": dict(async_generation=True, max_staleness=2, lazy_weight_loading=True),
    "async_k2_eval": dict(async_generation=True, max_staleness=2, **EVALUATING),
    "trl_eval": dict(EVALUATING),
    "async_sync3_eval": dict(async_generation=True, max_staleness=1, weight_sync_steps=3, **EVALUATING),
    "async_sync3": dict(async_generation=True, max_staleness=1, weight_sync_steps=3),
    "replay_saves": dict(replay_buffer_size=8, replay_ratio=0.5, replay_saves_generation=True),
    "async_k1_lora": dict(async_generation=True, max_staleness=1),
    "async_partial_lora": dict(async_generation=True, partial_rollout_budget=3, partial_rollout_max_resumes=2),
    "async_inflight_lora": dict(async_generation=True, max_staleness=2, inflight_update_tokens=2),
    "async_k2_two_servers_lora": dict(async_generation=True, max_staleness=2),
}
#: LoRA rows: a peft model (rank 4 on q_proj and v_proj) whose pushes carry only the adapter (vllm_lora_sync="adapter",
#: the default): every server loads each push under a fresh name and unloads the one it replaces, and a request names
#: the adapter of the push it was queued after. Besides the row's checks (the behaviour log-probs are recomputed with
#: the saved LoRA policy of each token's version): every request named an adapter, never one already unloaded (the
#: stand-in answers such a name 404, as vLLM does), and the base weights were reloaded once per run.
LORA = {"async_k1_lora", "async_partial_lora", "async_inflight_lora", "async_k2_two_servers_lora"}
#: Rows that generate on several servers (``vllm_server_base_url`` lists them): every server answers requests and
#: loads every push, and the guarantees hold as with one.
SERVERS = {"async_k2_two_servers": 2, "async_k2_two_servers_lora": 2}
#: Rows whose trainer pushes as TRL's NCCL push does on CUDA: synchronously, holding the producer between two requests
#: (after the request of the batch it takes next has started), through TRL's own ``sync_weights`` (here the disk push):
#: ``TRLPort.gather_weights`` is patched to return None, as it does without a deferred push. A STAND-IN for CUDA's
#: path on CPU: the NCCL transfer itself cannot run here, the hold around it does.
HELD_PUSH = {"async_k1_held_push", "async_partial_held_push"}

#: Rows whose completions depend on timing: with in-flight updates, where a push lands in a request depends on when
#: it arrives; with lazy loading, whether a request runs before or after the push it could skip. There a resume trains
#: the same PROMPT multiset (nothing lost, nothing twice) under the same bounds.
TIMING_DEPENDENT = {"async_inflight", "async_k2_lazy", "async_inflight_lora"}
#: Rows whose resumes generate from newer weights than the uninterrupted run: with ``weight_sync_steps`` > 1 a resume
#: pushes at its first hand-over (the server's older weights are not in the checkpoint), so the batches generated
#: after it may differ; the prompt multiset and the bounds are the same.
RESUME_PUSHES = {"async_sync3", "async_sync3_eval"}

#: A slower stand-in server for these rows, so requests outlast a training step and pushes land inside them (or, lazy,
#: pushes wait while the producer is behind).
SECONDS_PER_TOKEN = {"async_inflight": 0.004, "async_k2_lazy": 0.004, "async_inflight_lora": 0.004}
#: Rows that evaluate at every step (async K=2: while batches generated by older weights are queued, GATED keeping them
#: queued): they also train exactly what the same row without evaluation trains, step by step (prompts,
#: completions, versions), so evaluating changes nothing that is trained. Not with weight_sync_steps > 1
#: (async_sync3_eval): an evaluation pushes the current weights and restarts the count, so later batches come from
#: weights the run without evaluation never pushed (the row's other checks hold).
EVALUATES = {"async_k2_eval", "trl_eval"}
#: Rows whose generation thread starts a batch's request only once the trainer asks for that batch or evaluates
#: (:class:`Gate`): at every evaluation the batches queued after the one trained last have not started, the case the
#: evaluation's wait is for, whatever the timing (a slowed server made it at some settings only).
GATED = {"async_k2_eval"}
#: Async rows (but the timing-dependent ones) train until a resume from checkpoint 1 must generate again: to batch
#: K + 2 (K + 1 at u >= 2), beyond what that checkpoint generated ahead and saved (with u + 2 steps, every resume
#: trained only saved batches); replay saving generation under async then also trains its first short batch. Where
#: that is over MAX_ROW_STEPS steps (u = 8 updates per batch: resuming from each of 25-33 checkpoints would take
#: minutes) the row keeps u + 2 steps and its resumes regenerate nothing.
MAX_ROW_STEPS = 12

#: The fast tier runs every source (but the timing-dependent in-flight row) on the setting with the most mid-batch
#: checkpoints per step that still keeps a row short; the slow tier runs the rest of the table.
FAST = (4, 1, 2)
#: Rows whose largest staleness equals the bound (staleness_bound, pinned to the README's formulas in
#: test_the_staleness_bound_is_the_documented_formula) wherever the row trains more steps than the bound: the bound is
#: tight there, so a looser one fails. (At u = 8 the async rows keep u + 2 steps, see MAX_ROW_STEPS: too few.)
TIGHT = {"trl", "async_k1", "async_k2"}
#: The user's own sampling settings: a ``seed`` in ``generation_kwargs`` (which once made every group copies of one
#: completion wherever a call held a group's members as prompts of their own) and a temperature other than 1 (the
#: behaviour log-probs are then the tempered policy's). Every source runs with them at USER_SAMPLING_SETTING, and
#: through the server on every source in test_user_sampling_settings_through_the_server.
USER_SAMPLING = dict(generation_kwargs={"seed": 11}, temperature=0.7)
USER_SAMPLING_SETTING = (1, 2, 2)
#: A group of k > 1 copies of one completion c, sampled with probability p (from its behaviour log-probs), is a defect
#: unless p ** (k - 1) >= CHANCE: the chance that independent draws agree with the first. A correct sampler trips it in
#: a group with probability below CHANCE; the one-seed-per-call defect makes every group copies, mostly of completions
#: far less likely (the tiny policies spread over ~40 tokens).
CHANCE = 1e-5


def digit_reward(completions, **kwargs) -> list[float]:
    """Spread inside almost every group even for an untrained head (so replay keeps groups and the loss moves)."""
    return [float(sum(ch.isdigit() for ch in c)) + 0.1 * len(c) for c in completions]


class SkipSaves(TrainerCallback):
    """While ``active``, the step's checkpoint is not written: the resumes from every checkpoint need only the
    uninterrupted run's checkpoints, and writing their own took about half of a row's time. (The uninterrupted run
    saves at every step and trains what the non-saving resumes train, so saving changes nothing that is trained; the
    fresh object and the second ``train()`` still save.)"""

    def __init__(self):
        self.active = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.active:
            control.should_save = False


class Gate(TrainerCallback):
    """A STAND-IN for a server slower than training, made deterministic: the generation thread's request for batch
    ``index`` waits until the trainer has asked for a batch at or after it (``Producer.take``), or is evaluating, or
    the run has ended (as a slower server would answer it then: the trainer's close waits for the request in flight).
    Reset when a run begins (a resume numbers its batches from the checkpoint's)."""

    def __init__(self):
        self.condition = threading.Condition()
        self.released, self.evaluating, self.ended, self.forced = -1, False, False, 0

    def on_train_begin(self, args, state, control, **kwargs):
        with self.condition:
            self.released, self.ended = -1, False

    def on_train_end(self, args, state, control, **kwargs):
        with self.condition:
            self.ended = True
            self.condition.notify_all()

    def hold(self, index) -> None:
        with self.condition:
            assert self.condition.wait_for(lambda: self.evaluating or self.ended or index <= self.released,
                                           timeout=60), index

    def release(self, index) -> None:
        with self.condition:
            self.released = max(self.released, index)
            self.condition.notify_all()

    @contextlib.contextmanager
    def open(self):
        with self.condition:
            self.evaluating = True
            self.condition.notify_all()
        try:
            yield
        finally:
            with self.condition:
                self.evaluating = False

    def patch(self, patches: pytest.MonkeyPatch) -> None:
        from bapo_trl.rollout.async_generation import AsyncGeneration

        generate, take, held = AsyncGeneration._generate, Producer.take, AsyncGeneration._held_for_evaluation
        gate = self

        def gated_generate(source, work):
            gate.hold(work.index)
            return generate(source, work)

        def releasing_take(producer, index):
            gate.release(index)
            return take(producer, index)

        @contextlib.contextmanager
        def opened_for_evaluation(source):
            if source.producer.last_queued_older_than(source.port.global_step) is not None:
                gate.forced += 1  # a batch queued after the last one trained has not started: the case tested
            with gate.open(), held(source):
                yield

        patches.setattr(AsyncGeneration, "_generate", gated_generate)
        patches.setattr(Producer, "take", releasing_take)
        patches.setattr(AsyncGeneration, "_held_for_evaluation", opened_for_evaluation)


def record_trained(trainer, compute_loss, model, inputs, *args, **kwargs):
    """Records every trained row of every micro-batch (around the real compute_loss, which then runs); with replay,
    at every micro-batch, the age of each group the queue holds."""
    if model.training:
        step = trainer.state.global_step
        trainer.trained += rows_of(inputs, step)
        queue = replay_queue_of(trainer)
        if queue is not None:
            trainer.queue_ages += [step - int(g["policy_version"][0]) for g in queue.groups]
    return compute_loss(model, inputs, *args, **kwargs)


def rows_of(inputs: dict, step: int) -> list[dict]:
    mask = loss_mask(inputs)
    versions = inputs.get("token_policy_version")
    rows = []
    for i in range(inputs["completion_ids"].size(0)):
        length = int(inputs["completion_mask"][i].sum())
        if not bool(mask[i].any()):
            continue
        token_versions = (versions[i, :length].tolist() if versions is not None
                          else [int(inputs["policy_version"][i])] * length)
        old = inputs.get("behaviour_per_token_logps", inputs.get("old_per_token_logps"))  # the behaviour
        prox = inputs.get("old_per_token_logps") if "behaviour_per_token_logps" in inputs else None
        rows.append({
            "step": step,
            "prompt": tuple(inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()),
            "completion": tuple(inputs["completion_ids"][i, :length].tolist()),
            "versions": tuple(token_versions),
            "old": None if old is None else old[i, :length].tolist(),
            "replayed": bool(inputs["replayed"][i]) if "replayed" in inputs else False,
            "prox": None if prox is None else prox[i, :length].tolist(),
        })
    return rows


def multiset(rows: list[dict], exact: bool = True) -> Counter:
    return Counter((r["prompt"], r["completion"], r["versions"]) if exact else r["prompt"] for r in rows)


def prompts_by_batch(rows: list[dict], updates: int, before: int) -> set:
    """The prompts each generation batch trains (``updates`` optimizer steps per batch; TRL shuffles a batch's rows
    over its steps with the global random state, which the first run advanced; a row whose every token is masked is
    not recorded, so this is a set)."""
    return {(r["step"] // updates, r["prompt"]) for r in rows if r["step"] < before}


def by_step(rows: list[dict]) -> Counter:
    return Counter((r["step"], r["prompt"], r["completion"], r["versions"]) for r in rows)


def updates_spanned(setting: tuple[int, int, int]) -> int:
    """The most optimizer steps one generation batch trains across, by walking TRL's schedule (a plain reference for
    ``BAPOConfig.updates_per_generation``): batch ``k`` trains micro-steps ``k S I`` to ``(k + 1) S I - 1``, and
    micro-step ``m`` belongs to update ``m // GA``."""
    steps_per_generation, num_iterations, accumulation = setting
    micro = steps_per_generation * num_iterations
    return max((k * micro + micro - 1) // accumulation - (k * micro) // accumulation + 1
               for k in range(2 * accumulation))


def config(source: str, setting: tuple[int, int, int], out: Path, servers: list, config_cls=BAPOConfig, **overrides):
    """The row's config (``config_cls``: BAPOConfig, or a subclass of it: a research candidate's); ``servers``: none
    (TRL's generation), one (host and port, TRL's way) or several (a list in ``vllm_server_base_url``)."""
    updates = updates_spanned(setting)
    extra = dict(SOURCES[source], **(USER_SAMPLING if setting == USER_SAMPLING_SETTING else {}))
    if "replay_buffer_size" in extra:  # the youngest age a replayed group can have, and more
        ahead = 1 + extra.get("max_staleness", 1) if extra.get("replay_saves_generation") else 0
        extra["replay_max_staleness"] = (3 + ahead) * updates
    if len(servers) == 1:
        host, port = servers[0].url.removeprefix("http://").split(":")
        extra.update(use_vllm=True, vllm_mode="server", vllm_server_host=host, vllm_server_port=int(port),
                     vllm_server_timeout=30)
    elif servers:
        extra.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=[s.url for s in servers],
                     vllm_server_timeout=30)
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1, seed=0,
        learning_rate=5e-3, lr_scheduler_type="constant", steps_per_generation=setting[0],
        num_iterations=setting[1], gradient_accumulation_steps=setting[2],
        max_steps=row_steps(source, updates),
        save_strategy="steps", save_steps=1, disable_tqdm=True)
    return cpu_config(out, config_cls=config_cls, **{**settings, **extra, **overrides})


def row_steps(source: str, updates: int) -> int:
    """u + 2 steps, or for the async rows as many as MAX_ROW_STEPS explains."""
    extra = SOURCES[source]
    if extra.get("async_generation") and source not in TIMING_DEPENDENT:
        longer = (extra.get("max_staleness", 1) + 2) * updates + 1
        if longer <= MAX_ROW_STEPS:
            return max(longer, updates + 2)
    return updates + 2


def lora_config(source: str):
    """The row's peft config (LORA rows), else None."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if source in LORA else None


def adapter_that_matters(model, seed: int = 0) -> None:
    """Give a fresh LoRA adapter a B that is not 0 (peft starts it at 0; an embedding's A): from the first push on, a
    sampler that ignored the adapter would differ from the trainer's policy far beyond the log-prob checks' bounds."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name or "lora_embedding_A" in name:
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def build(model_dir, args, probe=True, callbacks=(), peft=None, trainer_cls=None):
    """The row's trainer (``trainer_cls``: None for BAPOTrainer, or a subclass of it: a research candidate's);
    ``probe``: recording what each micro-batch trains (``trained``, ``queue_ages``); ``peft``: a peft config (LoRA
    rows)."""
    probe_cls = Probe if trainer_cls is None else probe_of(trainer_cls)
    recording = (dict(cls=probe_cls, around={"compute_loss": record_trained}, record=("trained", "queue_ages"))
                 if probe else {} if trainer_cls is None else dict(cls=trainer_cls))
    return tiny_trainer(model_dir, args, reward=digit_reward, prompts=64, prompt_seed=0,
                        eval_prompts=2 if args.eval_strategy != "no" else 0, eval_seed=5, callbacks=callbacks,
                        **recording, **({"peft_config": peft} if peft is not None else {}))


def check_versions_and_staleness(rows: list[dict], bound: int) -> None:
    for r in rows:
        assert max(r["versions"]) <= r["step"], r
        assert r["step"] - min(r["versions"]) <= bound, (r["step"], r["versions"], bound)


def check_groups_sampled_independently(rows: list[dict]) -> None:
    """A group's completions are independent draws: EVERY group of more than one completion has two that differ,
    unless copies are a plausible chance (CHANCE) under the policy that sampled them (copies are what one seed shared
    by the prompts of a call gives on vLLM and on the stand-in; see test_request_seeds.py)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["step"], r["prompt"]), []).append(r)
    assert groups
    for key, members in groups.items():
        if len(members) > 1 and len({m["completion"] for m in members}) == 1:
            old = members[0]["old"]
            probability = math.exp(sum(old)) if old is not None else 0.0
            assert probability ** (len(members) - 1) >= CHANCE, (
                f"group {key} is {len(members)} copies of one completion sampled with probability {probability:.2g}")


def check_behaviour_logps(rows: list[dict], policies: dict, model_dir, temperature: float, atol: float,
                          limit: int = 6, peft=None) -> int:
    """Each token's stored behaviour log-prob = its version's policy, recomputed (on rows with several versions
    first, then the stalest; a LoRA row's policy is the peft model's); returns how many rows were checked."""
    candidates = [r for r in rows if r["old"] is not None and r["completion"]]
    candidates.sort(key=lambda r: (-len(set(r["versions"])), min(r["versions"]) - r["step"]))
    checked = 0
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if peft is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft)
    for r in candidates[:limit]:
        behaviour_logps_match(model, policies, r["prompt"], r["completion"], r["versions"], r["old"], atol=atol,
                              temperature=temperature)
        checked += 1
    return checked


def generation_so_far(own_servers: list, server) -> float:
    """How much the servers of a row have generated: the stand-ins count their completion requests, the real vLLM
    server its generated tokens (its /metrics)."""
    if server is not None:
        return server.generated_tokens()
    return sum(each.requests["POST", "/v1/completions"] for each in own_servers)


def run_row(source: str, setting, model_dir, tmp_path: Path, server=None, atol: float = 2e-4, classes=None,
            check=None) -> None:
    """One row of the table (see the module doc); ``server``: a real vLLM server for the async rows, else the
    stand-in is started here. ``atol``: behaviour log-probs against the trainer's recomputation (the stand-in runs the
    same model code, float32; vLLM's CPU kernels differ by up to ~1e-4). ``classes``: ``(config class, trainer
    class)`` of a research candidate run on the row (None: BAPOConfig, BAPOTrainer); ``check``: its own checks,
    ``check(trainer, rows, policies, model_dir, args, peft)`` after the first run."""
    config_cls, trainer_cls = classes or (BAPOConfig, None)
    own_servers = [PolicyServer(model_dir, seconds_per_token=SECONDS_PER_TOKEN.get(source, 0.0))
                   for _ in range(SERVERS.get(source, 1))] if server is None and "async" in source else []
    servers = own_servers or ([] if server is None else [server])
    exact = source not in TIMING_DEPENDENT | RESUME_PUSHES
    patches, calls = pytest.MonkeyPatch(), []
    gate = Gate()
    if source in GATED:
        gate.patch(patches)
    if source in HELD_PUSH:
        patches.setattr(TRLPort, "gather_weights", lambda self: None)
        hold, take = Producer.between_requests, Producer.take
        patches.setattr(Producer, "between_requests", lambda self, after=None: calls.append(("hold", after)) or hold(
            self, after))
        patches.setattr(Producer, "take", lambda self, index: calls.append(("take", index)) or take(self, index))
    try:
        args = config(source, setting, tmp_path / "out", servers, config_cls)
        snapshots, skip_saves = PolicySnapshots(), SkipSaves()
        peft = lora_config(source)
        trainer = build(model_dir, args, callbacks=[snapshots, skip_saves, gate], peft=peft, trainer_cls=trainer_cls)
        if peft is not None:
            adapter_that_matters(trainer.model)
        trainer.train()
        full = trainer.trained
        steps = args.max_steps
        bound = staleness_bound(args)
        assert {r["step"] for r in full} == set(range(steps))
        check_versions_and_staleness(full, bound)
        if source in TIGHT and steps > bound:  # the bound is reached (where the row is long enough to reach it)
            assert max(r["step"] - min(r["versions"]) for r in full) == bound, (source, setting, bound)
        if args.replay_buffer_size:  # groups were replayed; the queue holds only groups it may still replay
            replayed = [r for r in full if r["replayed"]]
            assert replayed and all(r["step"] > min(r["versions"]) for r in replayed), source
            assert max(trainer.queue_ages) <= args.replay_max_staleness, (source, max(trainer.queue_ages))
        check_groups_sampled_independently(full)
        checked = check_behaviour_logps(full, snapshots.policies, model_dir, args.temperature, atol, peft=peft)
        if check is not None:
            check(trainer, full, snapshots.policies, model_dir, args, peft)
        on_policy = setting[2] % (setting[0] * setting[1]) == 0  # TRL then skips the behaviour log-probs: ratio 1
        assert checked > 0 or source == "trl" and on_policy
        regenerates = steps > args.updates_per_generation + 2  # see MAX_ROW_STEPS
        if args.replay_saves_generation and (regenerates or not args.async_generation):
            # some batch was generated short and filled from the queue (and the resumes below cross it)
            assert any(h.get("replay/generation_saved", 0) > 0 for h in trainer.state.log_history), source
        if source in EVALUATES:
            assert sum("eval_loss" in h for h in trainer.state.log_history) == steps
            assert gate.forced or source not in GATED  # some evaluation found batches queued and not started
            plain = build(model_dir, config(source, setting, tmp_path / "plain", servers, config_cls,
                                            eval_strategy="no", save_strategy="no"),
                          callbacks=[gate], peft=peft, trainer_cls=trainer_cls)
            plain.train()
            # step by step: evaluation leaves training's random state as it found it (TRL's shuffle of each batch)
            assert by_step(full) == by_step(plain.trained), (source, setting)
        saved = tmp_path / "saved"  # moved away: a resumed run that wrote a checkpoint would show in out
        shutil.move(tmp_path / "out", saved)
        skip_saves.active = True
        for k in range(1, steps):
            trainer.trained = []
            generated = generation_so_far(own_servers, server)
            trainer.train(resume_from_checkpoint=str(saved / f"checkpoint-{k}"))
            if k == 1 and regenerates and servers:  # it generated beyond the batches the checkpoint saved
                assert generation_so_far(own_servers, server) > generated, source
            after = [r for r in full if r["step"] >= k]
            assert multiset(trainer.trained, exact) == multiset(after, exact), (source, setting, k)
            check_versions_and_staleness(trainer.trained, bound)
        assert not list((tmp_path / "out").glob("checkpoint-*"))
        skip_saves.active = False
        middle = steps // 2
        fresh = build(model_dir, config(source, setting, tmp_path / "fresh", servers, config_cls), callbacks=[gate],
                      peft=peft, trainer_cls=trainer_cls)
        fresh.train(resume_from_checkpoint=str(saved / f"checkpoint-{middle}"))
        assert multiset(fresh.trained, exact) == multiset([r for r in full if r["step"] >= middle], exact)
        trainer.trained = []
        trainer.train()  # a second run on the used object: starts over, as a new trainer would
        assert {r["step"] for r in trainer.trained} == set(range(steps))
        check_versions_and_staleness(trainer.trained, bound)
        if not SOURCES[source].keys() & {"partial_rollout_budget", "replay_buffer_size"}:
            # the same prompts in each generation batch as the first run: its weights differ, its data order does not
            # (with partial rollout which groups finish, with replay which fresh groups give way, depend on weights)
            u = args.updates_per_generation
            whole = steps - steps % u  # a batch cut short by max_steps trains the part TRL's shuffle put first
            assert prompts_by_batch(trainer.trained, u, whole) == prompts_by_batch(full, u, whole), source
        if servers:  # it pushed its weights again at its first hand-over, and the generation thread loaded them
            assert trainer.state.log_history[0]["async/push_seconds"] > 0
            assert trainer.state.log_history[0]["async/load_seconds"] > 0 or source in HELD_PUSH
        if source in HELD_PUSH:  # the trainer loaded every push itself (the generation thread none), each push held
            # the producer once the batch the trainer took next had started
            assert all(h.get("async/load_seconds", 0) == 0 for h in trainer.state.log_history)
            assert own_servers[0].reloads > 0
            holds = [i for i, (what, _) in enumerate(calls) if what == "hold"]
            assert holds and all(calls[i][1] == next(index for what, index in calls[i + 1 :] if what == "take")
                                 for i in holds), calls
        if peft is not None:
            check_adapter_pushes([trainer, fresh], own_servers, runs=steps + 1)  # its first, resumes, a second
        if len(servers) > 1:  # several servers: each generated, each loaded every push
            assert all(s.requests["POST", "/v1/completions"] > 0 for s in servers), [s.requests for s in servers]
            assert len({s.reloads for s in servers}) == 1 and servers[0].reloads > 0, [s.reloads for s in servers]
    finally:
        patches.undo()
        for each in own_servers:
            each.close()


def check_adapter_pushes(trainers: list, servers: list, runs: int) -> None:
    """A LoRA row pushed adapters: the stand-ins (the real server keeps no such record) saw every generate request
    name an adapter loaded and not yet unloaded (none refused), each server's loads and unloads in one order, and the
    base weights reloaded once per run that pushed (the first trainer ran ``runs`` times: a later ``train()`` on the
    same object reloads them, the server may have restarted between; the others once): every other push carried the
    adapter only."""
    from bapo_trl.generation.adapter_sync import AdapterSync

    syncs = [trainer.vllm_generation.disk_sync for trainer in trainers]
    assert all(isinstance(sync, AdapterSync) for sync in syncs) and len(syncs[0].loaded_names) > 1
    assert 2 <= syncs[0].base_loads <= runs and all(sync.base_loads == 1 for sync in syncs[1:])
    assert not any(sync.restarts for sync in syncs)
    for server in servers:
        live, retired = set(), set()
        for event, name in server.lora_events:
            assert event != "unknown", (name, server.lora_events)
            if event == "load":
                live.add(name)
            elif event == "unload":
                live.discard(name)
                retired.add(name)
            else:
                assert name in live and name not in retired, (name, server.lora_events)
        assert any(event == "generate" for event, _ in server.lora_events)
        assert server.requests["RPC", "reload_weights"] == sum(sync.base_loads for sync in syncs), server.requests
    loads = [[e for e in server.lora_events if e[0] != "generate"] for server in servers]
    assert all(each == loads[0] for each in loads), loads  # every server loaded and unloaded the same adapters
