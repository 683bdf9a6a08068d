"""The scaffolding the trainer tests share: the CPU settings (:data:`CPU`, :func:`cpu_config`), one tiny-trainer
builder, one policy-snapshot callback, one behaviour log-prob check, one recording probe (and :func:`source_of`, to
reach a part of a trainer's rollout source, :func:`replay_queue_of` its replay queue).

Each test module keeps its own settings (model size, seeds, batch shapes) and passes them in; these helpers only
build, record and check, so a defect in one of them shows in every test that uses it instead of in one copy.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward
from bapo_trl.rollout.contract import parts
from bapo_trl.rollout.replay import ReplaySource

#: How every trainer test runs: on the CPU in float32, without gradient checkpointing, reporting nowhere. Once here so
#: that no test drifts from the others (TRL's defaults are bf16 and gradient checkpointing on).
CPU = dict(use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none")


def cpu_config(output_dir, *, config_cls=BAPOConfig, **settings):
    """``config_cls`` (BAPOConfig, or TRL's GRPOConfig) writing to ``output_dir`` with :data:`CPU` and ``settings``;
    a setting named in both is the test's (a test that keeps TRL's default for one states it here)."""
    return config_cls(output_dir=str(output_dir), **{**CPU, **settings})


def source_of(trainer, cls):
    """The part of ``trainer``'s rollout source (the source itself or one it wraps) that is a ``cls``; None if none."""
    return next((p for p in parts(trainer.rollout_source) if isinstance(p, cls)), None)


def replay_queue_of(trainer):
    """The queue of ``trainer``'s replay source (None without replay)."""
    source = source_of(trainer, ReplaySource)
    return None if source is None else source.queue


def tiny_trainer(model_dir, args, *, cls=BAPOTrainer, reward=reverse_reward, prompts: int = 64, prompt_seed: int = 0,
                 eval_prompts: int = 0, eval_seed: int = 5, callbacks=(), model=None, **kwargs):
    """A trainer (``cls``: BAPOTrainer, :class:`Probe`, TRL's GRPOTrainer) on the tiny model in ``model_dir`` with
    ``args``, the toy reverse task (``prompts`` prompts drawn with ``prompt_seed``; ``eval_prompts`` > 0 adds an eval
    set drawn with ``eval_seed``) and the tiny model's tokenizer. Exists so that every test builds its trainer the same
    way and states only what it changes; ``model``: a model (or a path for the trainer to load) instead of a fresh
    copy of ``model_dir``'s; other keywords go to ``cls`` (``peft_config``, a :class:`Probe`'s ``around``...)."""
    return cls(model=AutoModelForCausalLM.from_pretrained(model_dir) if model is None else model,
               reward_funcs=reward, args=args, train_dataset=make_reverse_dataset(prompts, seed=prompt_seed),
               processing_class=AutoTokenizer.from_pretrained(model_dir),
               **({"eval_dataset": make_reverse_dataset(eval_prompts, seed=eval_seed)} if eval_prompts else {}),
               callbacks=list(callbacks), **kwargs)


class PolicySnapshots(TrainerCallback):
    """The policy at the start of every optimizer step (the weights of version ``step``: what a sampler or a push at
    that step used), and when each step ended (``step_ends[b]``: the step that trained on batch b). Exists so that a
    test can recompute behaviour log-probs with the policy of each token's version afterwards
    (:func:`check_behaviour_logps`). The first run that reaches a step records it: a resume on the same object keeps
    the uninterrupted run's policies."""

    def __init__(self):
        self.policies, self.step_ends = {}, {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step not in self.policies:
            self.policies[state.global_step] = copy.deepcopy(model.state_dict())

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends[state.global_step - 1] = time.perf_counter()


def logps_under(model, policy: dict, ids: torch.Tensor, width: int, temperature: float = 1.0,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The log-probs of the last ``width`` tokens of each row of ``ids`` under ``policy`` (loaded into ``model``),
    at ``temperature``."""
    model.load_state_dict(policy)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, -width - 1 : -1]
    logps = torch.log_softmax(logits.float() / temperature, -1)
    return logps.gather(-1, ids[:, -width:, None]).squeeze(-1)


def check_behaviour_logps(model, policies: dict, prompt_ids, completion_ids, versions, behaviour, *, atol: float,
                          temperature: float = 1.0, attention_mask=None, mask=None, newest: int | None = None
                          ) -> float:
    """Asserts that every token's stored behaviour log-prob (``behaviour``) equals a recomputation with the saved
    policy of that token's version (``policies``, from :class:`PolicySnapshots`) within ``atol``: the off-policy
    guarantee that BAPO's ratio compares against the policy that really sampled. Exists once so every source (TRL's,
    replay, partial rollout, async) is held to the same recomputation.

    One completion (lists, or 1-D tensors) or a batch (2-D tensors, rows as stored: ``attention_mask`` over prompt and
    completion, ``mask`` the completion tokens to compare). ``versions``: per token, or one for all. Returns, where
    ``newest`` is given, the largest gap between the stored log-probs of tokens older than ``newest`` and policy
    ``newest``'s (> 0: the versions really differ), else 0."""
    def rows(x, dtype=None):
        x = torch.as_tensor(x, dtype=dtype)
        return x if x.dim() == 2 else x[None]

    prompt_ids, completion_ids = rows(prompt_ids, torch.long), rows(completion_ids, torch.long)
    behaviour = rows(behaviour, torch.float32)
    versions = torch.as_tensor(versions).expand(completion_ids.shape) if torch.as_tensor(versions).dim() == 0 else \
        rows(versions)
    mask = torch.ones_like(completion_ids, dtype=torch.bool) if mask is None else rows(mask).bool()
    ids, width = torch.cat([prompt_ids, completion_ids], 1), completion_ids.size(1)
    for version in sorted(set(versions[mask].tolist())):
        expected = logps_under(model, policies[version], ids, width, temperature, attention_mask)
        at = mask & (versions == version)
        assert torch.allclose(expected[at], behaviour[at], atol=atol), (version, expected[at], behaviour[at])
    if newest is None:
        return 0.0
    older = mask & (versions < newest)
    if not bool(older.any()):
        return 0.0
    current = logps_under(model, policies[newest], ids, width, temperature, attention_mask)
    return float((current[older] - behaviour[older]).abs().max())


class ProbeMixin:
    """A trainer whose chosen methods are wrapped to record what they saw (the real methods always run: a probe,
    not a fake). Exists so the tests record the micro-batches the loss trained, the batches a source handed over,
    the calls generation made... with one mechanism instead of a subclass each.

    ``around`` maps where a method is to a wrapper ``wrapper(trainer, real, *args, **kwargs)`` that calls ``real``
    and returns its result: where is a dotted path from the trainer (``"compute_loss"``,
    ``"rollout_source.next_batch"``) or ``(cls, path)``: the path from the part of the rollout source that is a
    ``cls`` (:func:`source_of`; skipped where there is none). ``record`` names list attributes created empty, for
    the wrappers to fill."""

    def __init__(self, *args, around: dict | None = None, record: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        for name in record:
            setattr(self, name, [])
        for where, wrapper in (around or {}).items():
            self.wrap(where, wrapper)

    def wrap(self, where, wrapper: Callable) -> None:
        owner, path = (self, where) if isinstance(where, str) else (source_of(self, where[0]), where[1])
        if owner is None:
            return
        *attrs, name = path.split(".")
        for attr in attrs:
            owner = getattr(owner, attr)
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            return wrapper(self, real, *args, **kwargs)

        setattr(owner, name, wrapped)


class Probe(ProbeMixin, BAPOTrainer):
    """A BAPOTrainer probe (:class:`ProbeMixin`)."""


def probe_of(trainer_cls: type) -> type:
    """The :class:`ProbeMixin` probe of another trainer class (a research candidate's, e.g.)."""
    return type(f"{trainer_cls.__name__}Probe", (ProbeMixin, trainer_cls), {})
