"""Async generation with partial rollout as a rollout source: each round the vLLM server grows every unfinished
completion by the budget while the trainer trains.

A completion may grow across several rounds, under newer policies, each token keeping the sampler's log-prob and
version. Rounds depend on the previous round's tokens, so the producer runs exactly one round ahead
(``max_staleness`` 1). The pool lives on the main process; a checkpoint saves it, the prompt stream's position and
the round in flight (waiting for it to end), so a resume continues exactly where the uninterrupted run was.
"""

from __future__ import annotations

from transformers.utils import logging

from ..core.metrics import partial_sums, partial_values
from .async_generation import AsyncGeneration, Handover, decode_batch, encode_batch, request_seed
from .contract import TrainerPort
from .pool import Completion, PartialRolloutPool
from .producer import Work
from .settings import setting_differences

logger = logging.get_logger(__name__)


class AsyncPartialRollout(AsyncGeneration):
    """Async generation whose batches are the finished groups of a pool grown one round ahead."""

    def __init__(self, port: TrainerPort):
        super().__init__(port)
        settings = port.settings
        self.pool = PartialRolloutPool(settings.partial_rollout_budget, settings.partial_rollout_max_resumes,
                                       settings.max_completion_length, port.stop_token_ids())
        self.groups_per_batch = settings.generation_batch_size // port.num_generations
        self.round_submitted: int | None = None  # the round (batch index) queued last
        self.stream_position = 0
        self._restored_round: dict | None = None

    @property
    def next_request(self) -> tuple:
        return ("round", self.handed)

    def state_dict(self) -> dict:
        position = self.stream.position if self.stream is not None else self.stream_position
        state = {"batches_handed": self.handed, "stream_position": position, "pool": self.pool.state_dict(),
                 "sampled_under": self.port.settings.sampling, "rounds": self._round_settings()}
        if self.producer is not None and self.round_submitted == self.handed:  # the round in flight: its result
            batch = self.producer.wait_for(("round", self.handed))
            state["round"] = encode_batch(batch) | {"context": None}  # its completions are the pool's unfinished
        elif self.producer is None and self._restored_round is not None:  # resumed, not sent yet: still in flight
            state["round"] = self._restored_round
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.producer is not None:
            raise RuntimeError("async generation: cannot load state once generation has started")
        self.handed = self.submitted = int(state["batches_handed"])
        self.stream_position = int(state["stream_position"])
        cut = self.pool.load_state_dict(state["pool"])
        self._restored_round = state.get("round")  # older checkpoints: the round is generated again
        changed = setting_differences(state.get("sampled_under", self.port.settings.sampling),
                                      self.port.settings.sampling)
        rounds = self._round_settings()  # the round's caps came from them
        changed += setting_differences(state.get("rounds", rounds), rounds)
        if self._restored_round is not None and (changed or cut):  # it grew the pool as it was, under those settings
            logger.warning(
                "resume_from_checkpoint: the partial-rollout round the checkpoint generated ahead is generated again, "
                f"under this run's settings ({', '.join(changed) or 'max_completion_length cut its pool'}).")
            self._restored_round = None

    def _round_settings(self) -> dict:
        """The settings a round's caps are computed from: a round saved under others is not the one this run sends
        (its answers, applied under the new caps, would mark a completion stopped at its old cap as finished)."""
        settings = self.port.settings
        return {"partial_rollout_budget": settings.partial_rollout_budget,
                "partial_rollout_max_resumes": settings.partial_rollout_max_resumes}

    def _start(self) -> None:
        if self.producer is None:
            super()._start()
            self.stream.skip_to(self.stream_position)  # the groups drawn so far are in the restored pool

    def _main_next(self, push_seconds: float) -> Handover:
        pool = self.pool
        if self.round_submitted != self.handed:  # the first call (or the first after a resume)
            self._submit_round(self.handed, restored=self._restored_round)
            self._restored_round = None
        batch, waited = self.producer.take(("round", self.handed))
        todo, caps = batch.work.context
        pool.apply(todo, caps, batch.completion_ids, batch.logps, batch.logps, batch.version)
        seconds, lag = batch.seconds, batch.weight_sync_lag
        short = self.groups_per_batch - pool.num_ready()
        oldest = [g for g in pool.groups if not g.finished][: max(short, 0)]
        todo = [c for g in oldest for c in g.completions if not c.finished]
        if todo:  # too few finished groups: generate the oldest unfinished ones to the end, now
            prefixes, caps = pool.request(todo, pool.max_len)
            self.producer.submit(Work(("finish", self.handed), prefixes, 1, max(caps), context=(todo, caps),
                                      seed=request_seed(self.port.settings.seed, 2 * self.handed + 1),
                                      min_version=self.pushed_step))
            batch, extra_wait = self.producer.take(("finish", self.handed))
            pool.apply(todo, caps, batch.completion_ids, batch.logps, batch.logps, batch.version)
            waited, seconds = waited + extra_wait, seconds + batch.seconds
            lag = max((x for x in (lag, batch.weight_sync_lag) if x is not None), default=None)  # the round's worst
        carried = pool.end_step()
        groups = pool.pop_ready(self.groups_per_batch)
        self._submit_round(self.handed + 1)  # generated while this batch trains
        completions = [c for g in groups for c in g.completions]
        versions = [list(c.versions) for c in completions]
        metrics = self._batch_metrics(versions, seconds, waited, push_seconds, lag)
        metrics.update(partial_values(*partial_sums(completions, carried, self.port.global_step)))  # global batch
        return Handover(rows=[row for g in groups for row in g.rows], prompt_ids=[c.prompt_ids for c in completions],
                        completion_ids=[list(c.token_ids) for c in completions],
                        logps=[list(c.logps) for c in completions], versions=versions, metrics=metrics)

    def _submit_round(self, index: int, restored: dict | None = None) -> None:
        """Top the pool up to two batches' worth of groups and queue one request growing every unfinished
        completion: by the budget, or to the end for one carried ``max_resumes`` times. ``restored``: that request's
        result, saved by the checkpoint we resumed from (the pool is then exactly as it was when it was sent)."""
        port, pool = self.port, self.pool
        while len(pool) < 2 * self.groups_per_batch:
            indices = self.stream.next()
            rows = [dict(port.train_dataset[i]) for i in indices]
            pool.add_groups(rows, port.tokenize_prompts([row["prompt"] for row in rows]), port.num_generations)
        todo: list[Completion] = pool.unfinished()
        wanted = [pool.budget if c.resumes < pool.max_resumes else pool.max_len for c in todo]
        prefixes, caps = pool.request(todo, wanted)
        work = Work(("round", index), prefixes, 1, max(caps), context=(todo, caps),
                    seed=request_seed(port.settings.seed, 2 * index), min_version=self.pushed_step)
        if restored is not None:
            self.producer.preload({work.index: decode_batch(restored, context=work.context)})
        else:
            self.producer.submit(work)
        self.round_submitted = index
