"""Async generation: the vLLM server generates the next batches while the trainer trains (issue 17).

Fast tier: the prompt stream, the producer's pacing and push ordering (a scripted generator in place of the server,
named as such), configuration and argument errors, and a stalled server (the stand-in server of
support/policy_server.py). Slow tier: the real vLLM CPU server: overlap, staleness bounded by K, behaviour log-probs
equal to a recomputation with the saved sampling policy, resume without loss or duplication, LoRA, and ZeRO-3 on 2
processes through train_bapo.py.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from trl.trainer.utils import RepeatSampler

from bapo_trl import BAPOConfig
from bapo_trl.rollout.async_generation import AsyncGeneration, decode_batch, encode_batch
from bapo_trl.rollout.producer import Producer, PromptStream, Work
from support.async_launches import zero3_async_from_train_bapo
from support.harness import CPU, PolicySnapshots, Probe, check_behaviour_logps, cpu_config, tiny_trainer
from support.policy_server import PolicyServer
from support.server_training import completion_length, reset_server_weights, train_with_server

pytestmark = pytest.mark.usefixtures("use_test_cache")

# -- the prompt stream -------------------------------------------------------------------------------------------


def test_prompt_stream_draws_as_trls_repeat_sampler_and_resumes_where_it_stopped():
    stream = PromptStream(num_rows=10, num_generations=2, batch_rows=6, shuffle=True, seed=3)
    batches = [stream.next() for _ in range(7)]  # 3 batches of 3 prompts per epoch: 7 spans three epochs
    reference = RepeatSampler(range(10), mini_repeat_count=2, batch_size=3, shuffle=True, seed=3)
    expected = [i for _ in range(3) for i in list(reference)[:9 * 2]]  # each epoch drops the incomplete last chunk
    assert [i for b in batches for i in b] == expected[: 7 * 6]
    assert all(b[0::2] == b[1::2] for b in batches)  # a group's copies side by side
    resumed = PromptStream(num_rows=10, num_generations=2, batch_rows=6, shuffle=True, seed=3)
    resumed.skip_to(4)
    assert [resumed.next() for _ in range(3)] == batches[4:]


def test_prompt_stream_refuses_a_batch_of_partial_groups():
    with pytest.raises(ValueError, match="whole groups of 4"):
        PromptStream(num_rows=10, num_generations=4, batch_rows=6, shuffle=False, seed=0)


# -- the producer (a scripted generator in place of the server) --------------------------------------------------


class ScriptedGenerator:
    """Stands in for the server's generate request (a scripted fake): returns one token per completion, can be held
    mid-request, records when each request ran."""

    def __init__(self):
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Event()
        self.calls = []

    def __call__(self, work):
        self.started.set()
        self.calls.append(("start", time.perf_counter()))
        assert self.release.wait(30)
        self.calls.append(("end", time.perf_counter()))
        return {"completion_ids": [[7] for _ in work.prompts for _ in range(work.n)],
                "logps": [[-0.5] for _ in work.prompts for _ in range(work.n)]}


def test_each_batch_records_how_far_the_servers_weights_were_behind_the_trainer_when_its_request_started():
    """``weight_sync_lag`` = the trainer's step read as the request starts (the producer's clock) - the version the
    server held; a batch restored from an older checkpoint (no trainer step) reports none."""
    generate, steps = ScriptedGenerator(), iter([3, 7])
    producer = Producer(generate, request_timeout=10, clock=lambda: next(steps))
    try:
        producer.version = 2
        producer.submit(Work(0, [[1]], n=1, max_tokens=4, context=[0]))
        first, _ = producer.take(0)
        producer.version = 6
        producer.submit(Work(1, [[1]], n=1, max_tokens=4, context=[1]))
        second, _ = producer.take(1)
    finally:
        producer.close()
    assert (first.trainer_step, first.weight_sync_lag, second.weight_sync_lag) == (3, 1, 1)
    restored = decode_batch({**encode_batch(first), "trainer_step": None})
    assert restored.weight_sync_lag is None and decode_batch(encode_batch(second)).weight_sync_lag == 1


def test_a_push_waits_for_the_request_in_flight_and_later_batches_carry_its_version():
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10)
    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=2, max_tokens=4, context=[0, 0]))
        assert generate.started.wait(10)
        pushed = []

        def push():
            with producer.between_requests():
                pushed.append(time.perf_counter())
                producer.version = 5

        pusher = threading.Thread(target=push)
        pusher.start()
        # Timing only in what a broken producer is given to show itself: 0.2 s for a push that does not wait to slip
        # in (a correct producer passes whatever the machine's speed: the request is held until released below; the
        # order of push and end is causal, the request ends before its lock is released)
        time.sleep(0.2)
        assert not pushed  # the request in flight holds the push back ...
        generate.release.set()
        pusher.join(10)
        assert pushed and pushed[0] >= generate.calls[1][1]  # ... until it has ended
        producer.submit(Work(1, [[2]], n=2, max_tokens=4, context=[1, 1]))
        first, _ = producer.take(0)
        second, _ = producer.take(1)
        assert (first.version, second.version) == (0, 5)  # batch 0 on the old weights, batch 1 on the pushed ones
        assert second.prompt_ids == [[2], [2]] and second.work.context == [1, 1]
    finally:
        producer.close()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_lazy_producer_loads_a_push_only_when_the_next_work_needs_it(lazy):
    """Pushes of steps 1 and 2 are handed over while work queued earlier (min_version 0 and 1) waits: eagerly each
    request is generated by exactly the push it was queued after (its min_version), however far behind the producer
    is; lazily the work that weights 0 satisfy runs on them, the work that needs 1 loads the newest push (2), and the
    push is then no longer pending."""
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10, lazy=lazy)
    loads = []

    def push(step):
        return (lambda: loads.append(step)), step

    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=1, max_tokens=4, min_version=0))
        assert generate.started.wait(10)
        producer.push_later(*push(1))
        producer.push_later(*push(2))  # both pending: work queued before the push of 2 keeps its older push
        producer.submit(Work(1, [[2]], n=1, max_tokens=4, min_version=0))
        producer.submit(Work(2, [[3]], n=1, max_tokens=4, min_version=1))
        producer.submit(Work(3, [[4]], n=1, max_tokens=4, min_version=2))
        generate.release.set()
        versions = [producer.take(i)[0].version for i in range(4)]
        if lazy:
            assert versions == [0, 0, 2, 2] and loads == [2]
        else:
            assert versions == [0, 0, 1, 2] and loads == [1, 2]
        assert producer.take_load_seconds() >= 0 and producer.take_load_seconds() == 0.0  # read once
        for i, work_min in enumerate([0, 0, 1, 2]):
            assert versions[i] >= work_min
    finally:
        producer.close()


def test_a_request_queued_before_a_push_keeps_its_own_push_however_late_it_starts():
    """K = 1 as the trainer runs it: the batch queued at a hand-over must be generated by that hand-over's push, even
    when the generation thread starts it only after the NEXT push was handed over (a fast trainer step, a thread not
    scheduled: seen against the real vLLM server, where such a batch took the newer push and a resumed run diverged).
    A push no queued work needs any more is skipped."""
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10)
    loads = []
    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=1, max_tokens=4, min_version=0))
        assert generate.started.wait(10)  # the thread is busy: what follows queues up behind this request
        producer.push_later(lambda: loads.append(2), 2)
        producer.submit(Work(1, [[2]], n=1, max_tokens=4, min_version=2))  # queued at hand-over 2
        producer.push_later(lambda: loads.append(4), 4)  # the next hand-over, before batch 1 started
        producer.push_later(lambda: loads.append(6), 6)
        producer.submit(Work(2, [[3]], n=1, max_tokens=4, min_version=6))
        generate.release.set()
        assert [producer.take(i)[0].version for i in range(3)] == [0, 2, 6]
        assert loads == [2, 6]  # the push of 4 was needed by no request
    finally:
        producer.close()


@pytest.mark.parametrize("after", [None, 1])
def test_a_held_push_waits_until_the_batch_needed_next_has_started(after):
    """The trainer's own push (the shape of TRL's NCCL push on CUDA: the trainer holds the producer between two
    requests and loads the weights itself). Batch 1 is queued behind batch 0 in flight when the push comes: held with
    ``after=1`` (the batch the trainer takes next), the push waits until batch 1 has started and ended, and batch 1
    keeps the weights it was queued after; without it, the push slips in between the two requests and batch 1 takes
    the newer weights (the Finding 3 race on the synchronous push)."""
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10)
    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=1, max_tokens=4, min_version=0))
        assert generate.started.wait(10)
        producer.submit(Work(1, [[2]], n=1, max_tokens=4, min_version=0))
        pushed = threading.Event()

        def push():
            with producer.between_requests(after=after):
                producer.version = 5
            pushed.set()

        pusher = threading.Thread(target=push)
        pusher.start()
        time.sleep(0.2)  # timing only in what a broken producer is given to push early (see the test above)
        assert not pushed.is_set()  # batch 0 is in flight
        generate.release.set()
        pusher.join(10)
        assert pushed.is_set()
        versions = [producer.take(i)[0].version for i in range(2)]
        assert versions == ([0, 0] if after is not None else [0, 5])
    finally:
        producer.close()


@pytest.mark.parametrize("lazy, defers, inflight, waits", [
    (False, True, None, True),   # exact pushes: the queued requests with older weights run first
    (True, True, None, False),   # lazy, pushes handed over (the disk reload): they may take the newest anyway
    (True, False, None, True),   # lazy, but pushes held between requests (TRL's NCCL push on CUDA): lazy does nothing
    (False, True, 2, False),     # in-flight updates take the newest weights between chunks
])
def test_evaluation_waits_for_the_queued_requests_wherever_pushes_are_exact(lazy, defers, inflight, waits):
    """Which evaluations first let the queued requests with older weights run: every one but where those requests
    take the newest weights anyway. ``lazy_weight_loading`` acts only on pushes handed over to the producer; with
    pushes held between two requests (CUDA) it once turned the wait off although every push there is exact."""
    from types import SimpleNamespace

    holds = []

    @contextlib.contextmanager
    def between_requests(after=None):
        holds.append(after)
        yield

    producer = SimpleNamespace(lazy=lazy, last_queued_older_than=lambda version: 7, apply_pending=lambda: None,
                               between_requests=between_requests)
    source = AsyncGeneration.__new__(AsyncGeneration)
    source.producer, source.defers_pushes = producer, defers
    source.port = SimpleNamespace(settings=SimpleNamespace(inflight_update_tokens=inflight), global_step=5,
                                  weights_step=4)
    with source._held_for_evaluation():
        pass
    assert holds == [7 if waits else None]


def test_the_last_queued_request_older_than_a_push_is_the_one_to_let_run_first():
    """Evaluation applies the current policy's weights: the requests queued before it with older weights must run
    first. ``last_queued_older_than`` names the last of them among the work not started (None: none), and a request
    in flight or done no longer counts."""
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10)
    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=1, max_tokens=4, min_version=0))
        assert generate.started.wait(10)  # in flight: not counted
        for index, version in ((1, 2), (2, 2), (3, 4), (4, None)):
            producer.submit(Work(index, [[index]], n=1, max_tokens=4, min_version=version))
        assert [producer.last_queued_older_than(v) for v in (0, 1, 2, 3, 4, 5, 9)] == [None, None, None, 2, 2, 3, 3]
        producer.push_later(lambda: None, 2)
        producer.drop_pending()
        generate.release.set()
        assert [producer.take(i)[0].version for i in range(5)] == [0] * 5  # the dropped push was never applied
        assert producer.last_queued_older_than(9) is None
    finally:
        producer.close()


def test_a_held_push_waiting_for_a_request_that_never_starts_is_an_error():
    """Bounded like every wait of the trainer: a request stuck ahead of the batch needed next is a ProducerStalled
    error naming that batch, not a hang (a scripted generator holding its first request)."""
    from bapo_trl.rollout.producer import ProducerStalled

    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=0.2)
    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=1, max_tokens=4))
        assert generate.started.wait(10)
        producer.submit(Work(1, [[2]], n=1, max_tokens=4))
        with pytest.raises(ProducerStalled, match=r"batch 1 did not start within 1 s"):
            with producer.between_requests(after=1):
                pass
    finally:
        generate.release.set()
        producer.close()


class ScriptedClock:
    """The producer's clock, moved by the test alone (``time`` of bapo_trl.rollout.producer patched): a bound that
    is a time is checked against scripted durations, whatever the machine's load. The trainer's side of a wait
    re-checks its bound whenever the producer's condition is notified (its real-time sleeps between checks decide
    nothing); :meth:`advance` moves the clock, then wakes that side and returns once it has checked the new time
    (or no longer waits), so a broken bound is caught at the step where it is broken, not only if the threads
    happen to interleave."""

    def __init__(self, monkeypatch, producer: Producer):
        import bapo_trl.rollout.producer as producer_module

        self.now, self.producer, self.checks, self.done = 0.0, producer, 0, False
        self.counted = threading.Condition()
        clock = self

        class Counted(threading.Condition):
            def wait(self, timeout=None):  # called by the waiting side after each check of its bound
                with clock.counted:
                    clock.checks += 1
                    clock.counted.notify_all()
                return super().wait(timeout)

        monkeypatch.setattr(producer_module, "time", SimpleNamespace(perf_counter=lambda: self.now))
        producer.condition = Counted()  # before any work: the producer's thread waits on its queue until then

    def advance(self, seconds: float) -> None:
        with self.producer.condition:
            self.now += seconds
            seen = self.checks
            self.producer.condition.notify_all()
        with self.counted:  # the bound only turns a hang into an error
            assert self.counted.wait_for(lambda: self.checks > seen or self.done, timeout=60)

    def finish(self) -> None:
        """The waiting side is done (returned or raised): :meth:`advance` no longer waits for it."""
        with self.counted:
            self.done = True
            self.counted.notify_all()


def test_waiting_for_a_request_behind_several_is_bounded_per_request_not_in_all(monkeypatch):
    """Evaluation at K >= 2 may wait for several queued requests to run before the one it names starts: a healthy
    server answering each within its timeout must not look stalled, however many are queued (each start restarts
    the bound of 3.5 x the timeout). Five requests of 0.25 s ahead take 1.25 s, past one bound (0.7 s).
    Deterministic: the durations are a :class:`ScriptedClock`'s, the bound checked after each of them."""
    class Steady(ScriptedGenerator):
        def __call__(self, work):
            if work.index < 5:  # the request waited for, batch 5, only has to start
                clock.advance(0.25)
            return super().__call__(work)

    producer = Producer(Steady(), request_timeout=0.2)
    clock = ScriptedClock(monkeypatch, producer)
    try:
        for index in range(6):
            producer.submit(Work(index, [[index]], n=1, max_tokens=4, min_version=0))
        start = clock.now
        try:
            with producer.between_requests(after=5):
                waited = clock.now - start
        finally:
            clock.finish()
        assert waited == pytest.approx(1.25) and waited > producer.batch_bound, waited  # the case the restart is for
        assert [producer.take(i)[0].version for i in range(6)] == [0] * 6
    finally:
        clock.finish()
        producer.close()


class AnsweredInParts(ScriptedGenerator):
    """One batch answered request by request (a seeded batch: one HTTP request per prompt), ``parts`` answers ``gap``
    seconds apart, each counted in ``answered`` (the client's counter), or, ``stall_after``, none after that."""

    def __init__(self, parts: int, gap: float, stall_after: int | None = None):
        super().__init__()
        self.parts, self.gap, self.stall_after, self.answered = parts, gap, stall_after, 0

    def __call__(self, work):
        for part in range(self.parts):
            if part == self.stall_after:
                self.release.clear()
                assert self.release.wait(30)
            time.sleep(self.gap)
            self.answered += 1
        return super().__call__(work)


@pytest.mark.parametrize("wait", ["take", "hold"])
def test_a_large_batch_answered_request_by_request_is_not_a_stall(wait):
    """A batch of many requests takes longer than one request's bound, but the server answers all along: every bound
    restarts at each answer (progress), so neither taking the batch (3.5 x timeout = 0.7 s) nor holding the producer
    for a push (1.5 x timeout = 0.3 s) raises. 12 answers 0.1 s apart: 1.2 s in all. Without the progress the same
    waits raise (second half).

    Timing-based, on purpose: the bounds are times, and holding the producer waits on its request lock in real time,
    which a scripted clock (as in the test above) cannot wake. The slack: each 0.1 s gap is a third of the shortest
    bound (a thread held up 0.2 s between two answers would fail it), and the 1.2 s batch outlasts the longest bound
    by 0.5 s (the waits without progress raise with that much to spare)."""
    from bapo_trl.rollout.producer import ProducerStalled

    def run(progress: bool):
        generate = AnsweredInParts(parts=12, gap=0.1)
        producer = Producer(generate, request_timeout=0.2, progress=(lambda: generate.answered) if progress else None)
        try:
            producer.submit(Work(0, [[1]], n=1, max_tokens=4))
            while producer.in_flight is None and not generate.answered:
                time.sleep(0.01)
            if wait == "take":
                return producer.take(0)[0].version
            with producer.between_requests():
                return producer.take(0)[0].version
        finally:
            producer.close()

    assert run(progress=True) == 0
    with pytest.raises(ProducerStalled, match="of the server's last answer"):
        run(progress=False)


@pytest.mark.parametrize("wait, bound", [("take", 3.5), ("hold", 1.5)])
def test_a_stall_is_an_error_at_its_documented_bound_after_the_last_answer(wait, bound):
    """The stall bounds at their documented values, counted from the server's last answer: taking a batch 3.5 x the
    timeout, holding the producer for a push 1.5 x. Timing-based, on purpose (the bound IS a time, measured on the
    real clock): asserted from below exactly (no earlier error) and from above with a stated slack of 1.5 s (the waits
    re-check at least every second; a loaded machine adds delay)."""
    from bapo_trl.rollout.producer import ProducerStalled

    timeout = 0.4
    generate = AnsweredInParts(parts=3, gap=0.05, stall_after=2)
    producer = Producer(generate, request_timeout=timeout, progress=lambda: generate.answered)
    try:
        producer.submit(Work(0, [[1]], n=1, max_tokens=4))
        deadline = time.perf_counter() + 10
        while generate.answered < 2 and time.perf_counter() < deadline:
            time.sleep(0.01)
        last_answer = time.perf_counter()
        with pytest.raises(ProducerStalled):
            if wait == "take":
                producer.take(0)
            else:
                with producer.between_requests():
                    pass
        waited = time.perf_counter() - last_answer
        assert bound * timeout <= waited <= bound * timeout + 1.5, (waited, bound * timeout)
    finally:
        generate.release.set()
        producer.close()


def test_a_failed_request_is_raised_where_the_trainer_takes_the_batch():
    def broken(work):
        raise ConnectionError("server went away")

    producer = Producer(broken, request_timeout=10)
    producer.submit(Work(0, [[1]], n=1, max_tokens=4))
    with pytest.raises(ConnectionError, match="server went away"):
        producer.take(0)
    producer.close()


@pytest.mark.parametrize("chunked", [True, False])
def test_a_closed_producer_applies_no_push_and_starts_no_request_or_chunk(chunked):
    """What ends a run (``close``) returns once the request in flight has ended, and from then on nothing of the run
    reaches the server: a push handed over is not applied (a later run's push, or the adapter unload that follows,
    would otherwise race it), no later chunk and no queued request starts (they would name an adapter unloaded
    next)."""
    events, started, release = [], threading.Event(), threading.Event()

    def generate(work):  # scripted generator (no server): records each request and chunk it sends
        events.append(("request", work.index, producer.version))
        started.set()
        assert release.wait(30)
        for _ in range(3 if chunked else 0):
            events.append(("chunk", work.index, producer.between_chunks()))
        return {"completion_ids": [[7]] * work.n, "logps": [[-0.5]] * work.n}

    producer = Producer(generate, request_timeout=10)
    for index in range(2):
        producer.submit(Work(index, [[1]], n=2, max_tokens=4, min_version=0))
    assert started.wait(10)
    producer.push_later(lambda: events.append(("push", 1)), 1)
    closer = threading.Thread(target=producer.close)
    closer.start()
    while not producer._closed:  # close has begun (it marks the producer before it waits)
        time.sleep(0.01)
    time.sleep(0.1)
    assert closer.is_alive()  # it waits for the request in flight ...
    release.set()
    closer.join(10)
    assert not closer.is_alive()  # ... which then ends
    seen = list(events)
    time.sleep(0.3)  # timing only gives a broken producer time to show itself; a correct one has stopped
    assert events == seen == [("request", 0, 0)]
    assert producer.error is None


def test_closing_a_producer_whose_thread_failed_does_not_wait():
    def broken(work):
        raise ConnectionError("server went away")

    producer = Producer(broken, request_timeout=30)
    producer.submit(Work(0, [[1]], n=1, max_tokens=4))
    with pytest.raises(ConnectionError):
        producer.take(0)
    start = time.perf_counter()
    producer.close()
    assert time.perf_counter() - start < 5  # not the 30-s request bound: nothing is in flight


# -- configuration ------------------------------------------------------------------------------------------------

BASE = dict(CPU, output_dir="unused", gradient_checkpointing=True,  # TRL's default, as these checks have always run
            per_device_train_batch_size=8, num_generations=4)


@pytest.mark.parametrize("overrides,message", [
    (dict(async_generation=True), r"`async_generation` needs a vLLM server .*use_vllm=False"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="colocate"), r"vllm_mode='colocate'"),
    (dict(max_staleness=0), r"`max_staleness` must be an integer >= 1 .*got 0"),
    (dict(weight_sync_steps=0), r"`weight_sync_steps` must be an integer >= 1 .*got 0"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", partial_rollout_budget=2,
          max_completion_length=8, max_staleness=2), r"`max_staleness` must be 1, got 2"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", inflight_update_tokens=0),
     r"`inflight_update_tokens` must be an integer >= 1"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", partial_rollout_budget=2, max_completion_length=8,
          inflight_update_tokens=2), r"`inflight_update_tokens` cannot be combined with `partial_rollout_budget`"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_staleness=2, inflight_update_tokens=2,
          lazy_weight_loading=True), r"`lazy_weight_loading` cannot be combined with `inflight_update_tokens`"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_completion_length=8, inflight_update_tokens=8),
     r"`inflight_update_tokens` \(8\) must be below `max_completion_length` \(8\)"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_completion_length=8, inflight_update_tokens=2,
          generation_kwargs={"stop": ["\n"], "max_tokens": 4}),
     r"`generation_kwargs` keys \['max_tokens', 'stop'\] cannot be used with `inflight_update_tokens`"),
])
def test_async_settings_are_checked_before_anything_is_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        BAPOConfig(**{**BASE, **overrides})


ASYNC = dict(async_generation=True, use_vllm=True, vllm_mode="server")


@pytest.mark.parametrize("overrides,named", [
    (dict(top_p=0.9), "top_p=0.9"), (dict(top_k=20), "top_k=20"), (dict(min_p=0.05), "min_p=0.05"),
    (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
    (dict(generation_kwargs={"presence_penalty": 0.5}), "generation_kwargs['presence_penalty']"),
    (dict(generation_kwargs={"temperature": 0.7}), "generation_kwargs['temperature']"),
    (dict(vllm_structured_outputs_regex="[0-9]+"), "vllm_structured_outputs_regex"),
    (dict(partial_rollout_budget=2, max_completion_length=8, top_p=0.9), "top_p=0.9"),
])
def test_async_refuses_sampling_whose_log_probs_are_not_the_policys(overrides, named):
    """With top-p/top-k/min-p truncation or penalties, the server's processed log-probs belong to another
    distribution than the policy's: every async ratio would carry that bias. Refused, naming the setting."""
    with pytest.raises(ValueError, match="truncated or penalised") as error:
        BAPOConfig(**{**BASE, **ASYNC, **overrides})
    assert named in str(error.value) and "async_generation=False" in str(error.value)


@pytest.mark.parametrize("overrides,named", [
    (dict(generation_kwargs={"presence_penalty": 0.5}), "generation_kwargs['presence_penalty']"),
    (dict(generation_kwargs={"frequency_penalty": 0.5}), "generation_kwargs['frequency_penalty']"),
    (dict(generation_kwargs={"structured_outputs": {"regex": "[0-9]+"}}), "generation_kwargs['structured_outputs']"),
    (dict(vllm_structured_outputs_regex="[0-9]+"), "vllm_structured_outputs_regex"),
])
def test_partial_rollout_refuses_sampling_that_depends_on_the_tokens_generated_so_far(overrides, named):
    """Each partial-rollout round is a new request continuing the completion as its prompt: a grammar would restart
    and a penalty on generated tokens would forget the earlier rounds' (TRL samples a completion in one request).
    Refused synchronously too, naming the setting; settings without history (top_p) stay TRL's to correct."""
    with pytest.raises(ValueError, match="cannot be used with `partial_rollout_budget`: each round") as error:
        BAPOConfig(**{**BASE, "partial_rollout_budget": 2, "max_completion_length": 8, **overrides})
    assert named in str(error.value)
    BAPOConfig(**{**BASE, "partial_rollout_budget": 2, "max_completion_length": 8, "top_p": 0.9})


@pytest.mark.parametrize("overrides,named", [
    (dict(top_p=0.9), "top_p=0.9"), (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
    (dict(generation_kwargs={"temperature": 0.7}), "generation_kwargs['temperature']"),
])
def test_a_backend_of_ones_own_refuses_truncated_sampling_in_the_synchronous_sources_too(overrides, named):
    """A registered backend samples for every source and its log-probs are the behaviour log-probs there (not the
    trainer's recomputation TRL's generation corrects with its IS weight): truncated or penalised sampling is refused
    as under async, naming the setting and the backend."""
    from bapo_trl.generation.contract import register_backend

    register_backend("own_for_sampling_check", lambda trainer: None)
    with pytest.raises(ValueError, match="'own_for_sampling_check' samples for every source") as error:
        BAPOConfig(**{**BASE, "generation_backend": "own_for_sampling_check", "steps_per_generation": 2, **overrides})
    assert named in str(error.value) and "truncated or penalised" in str(error.value)


def test_async_refuses_asking_the_server_for_the_top_n_log_probs():
    """The behaviour log-prob is read as the server's first log-prob of each token, the sampled token's with
    logprobs=0; ``generation_kwargs['logprobs']=N`` would replace it by the most likely token's."""
    with pytest.raises(ValueError, match=r"`generation_kwargs\['logprobs'\]` cannot be used with `async_generation`"):
        BAPOConfig(**{**BASE, **ASYNC, "generation_kwargs": {"logprobs": 2}})


def test_sync_generation_keeps_trls_handling_of_truncated_sampling():
    BAPOConfig(**BASE, top_p=0.9, top_k=20, steps_per_generation=2)  # TRL's IS correction handles it: accepted


@pytest.mark.parametrize("name", ["max_staleness", "weight_sync_steps"])
def test_async_settings_without_async_warn_that_they_do_nothing(name):
    with pytest.warns(UserWarning, match=rf"`{name}` \(3\) only acts on async generation"):
        BAPOConfig(**BASE, **{name: 3}, steps_per_generation=2)


def test_lazy_loading_warns_where_it_can_change_nothing():
    with pytest.warns(UserWarning, match=r"`lazy_weight_loading` \(True\) only acts on async generation"):
        BAPOConfig(**BASE, lazy_weight_loading=True, steps_per_generation=2)
    with pytest.warns(UserWarning, match=r"`lazy_weight_loading` has no effect with `max_staleness`=1"):
        BAPOConfig(**BASE, lazy_weight_loading=True, async_generation=True, use_vllm=True, vllm_mode="server",
                   steps_per_generation=2)


def test_a_users_rollout_func_is_refused_with_async_generation():
    from bapo_trl.rollout.registry import check_source_arguments

    args = BAPOConfig(**BASE, async_generation=True, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="async generation .*would replace yours"):
        check_source_arguments(args, {"rollout_func": lambda prompts, trainer: {}})


def test_resuming_planned_short_batches_without_the_replay_that_fills_them_is_refused():
    """A checkpoint of async generation with replay_saves_generation holds batches generated (or planned) short, for
    replay to fill; resumed with it switched off, they would reach TRL short. Refused at load, before generating."""
    from types import SimpleNamespace

    port = SimpleNamespace(settings=SimpleNamespace(max_staleness=2, sampling={}))
    saved = {"batches_handed": 3, "batches_submitted": 3, "generated": [], "planned": {3: 0, 4: 1},
             "planned_upto": 5}
    with pytest.raises(ValueError, match=r"those batches would be short\. Resume with the checkpoint's settings"):
        AsyncGeneration(port).load_state_dict(saved)
    planned = AsyncGeneration(port)
    planned.plan_with(lambda index, ahead: 1)  # what ReplaySource does when replay_saves_generation is on
    planned.load_state_dict(saved)
    assert (planned.handed, planned.planned) == (3, {3: 0, 4: 1})
    AsyncGeneration(port).load_state_dict({**saved, "planned": {3: 0, 4: 0}})  # nothing left out: any settings


SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
           "max_completion_length": 8, "generation_kwargs": {}}


@pytest.mark.parametrize("change, regenerated", [
    ({}, False),
    ({"max_completion_length": 4}, True),
    ({"temperature": 0.7}, True),
    ({"generation_kwargs": {"stop_token_ids": [5]}}, True),
    (None, False),  # a checkpoint written before the settings were saved: kept, as before
    ({"max_staleness": 1}, True),  # generated up to 2 ahead: older than this run's bound
    ({"max_staleness": 3}, False),  # within it
])
def test_batches_generated_ahead_under_other_sampling_settings_are_generated_again(change, regenerated):
    """A resume whose sampling settings differ from the checkpoint's (a shorter max_completion_length, another
    temperature or generation_kwargs) does not train the batches the checkpoint generated ahead under the old ones:
    they are generated again, from the same stream position (same prompts, same request seeds), with a warning naming
    each change; the same settings keep them (what the uninterrupted run trains)."""
    from types import SimpleNamespace

    from transformers.testing_utils import CaptureLogger

    from bapo_trl.rollout import async_generation
    from bapo_trl.rollout.settings import sampled_under

    config = BAPOConfig(**BASE, max_completion_length=8, generation_kwargs='{"stop_token_ids": [5]}')
    assert sampled_under(config)["generation_kwargs"] == {"stop_token_ids": [5]}  # as TRL parses it from a flag
    batch = {"index": 3, "prompts": [[1, 2]], "n": 2, "max_tokens": 8, "context": [0, 0], "seed": 1,
             "completion_ids": [[3], [4]], "logps": [[-1.0], [-1.0]], "version": 2, "seconds": 0.1}
    saved = {"batches_handed": 3, "batches_submitted": 4, "generated": [batch], "planned": {}, "planned_upto": 4}
    if change is not None:
        saved.update(sampled_under=SAMPLED, max_staleness=2)
    change = dict(change or {})
    bound = change.pop("max_staleness", 2)
    now = {**SAMPLED, **change}
    source = AsyncGeneration(SimpleNamespace(settings=SimpleNamespace(max_staleness=bound, sampling=now)))
    assert source.state_dict()["sampled_under"] == now  # what a checkpoint of this run saves
    with CaptureLogger(async_generation.logger) as log:
        source.load_state_dict(saved)
    if regenerated:
        assert (source.handed, source.submitted, source._restored) == (3, 3, {})
        said = f"max_staleness (2 there, {bound} here)" if not change else \
            f"{next(iter(change))} ({SAMPLED[next(iter(change))]!r} there, {next(iter(change.values()))!r} here)"
        assert said in log.out and "generated again, from the same prompts" in log.out, log.out
    else:
        assert (source.handed, source.submitted, list(source._restored)) == (3, 4, [3])
        assert log.out == ""
        # checkpointed again before its first hand-over (a resume into TRL's saved batch in progress): the batch is
        # still ahead, saved as it was (it was saved as none: the next resume regenerated it under newer weights)
        again = source.state_dict()
        assert (again["batches_submitted"], again["generated"]) == (4, [{**batch, "token_versions": None,
                                                                          "trainer_step": None}])
        assert again["max_staleness"] == (2 if "sampled_under" in saved else bound)  # the bound they were made under


@pytest.mark.parametrize("saves_settings, change, regenerated", [
    (True, {}, False), (True, {"temperature": 0.7}, True), (True, {"max_completion_length": 3}, True),
    (False, {}, False),  # a checkpoint written before the settings were saved: kept, as before
    (False, {"max_completion_length": 3}, True),  # ... unless the new cap cut its pool
    (True, {"partial_rollout_budget": 8}, True),  # a capped completion would count as finished (the review's F1)
    (True, {"partial_rollout_max_resumes": 1}, True),
])
def test_the_partial_rollout_round_generated_ahead_under_other_settings_is_generated_again(saves_settings, change,
                                                                                           regenerated):
    """Async partial rollout's checkpoint holds the round in flight, which grew the pool as it was: resumed under other
    sampling settings (or a cap that cut the pool: the round's answers would land on other completions), or another
    budget or max_resumes (its caps: a completion stopped at its old cap would count as finished under a larger one),
    it is generated again; under the same ones it is kept."""
    from types import SimpleNamespace

    from bapo_trl.rollout.async_partial import AsyncPartialRollout
    from bapo_trl.rollout.pool import PartialRolloutPool

    def port(sampling, budget=4, max_resumes=3):
        settings = SimpleNamespace(partial_rollout_budget=budget, partial_rollout_max_resumes=max_resumes,
                                   generation_batch_size=4, max_completion_length=sampling["max_completion_length"],
                                   max_staleness=1, sampling=sampling)
        return SimpleNamespace(settings=settings, num_generations=2, stop_token_ids=lambda: [99])

    pool = PartialRolloutPool(budget=4, max_resumes=3, max_completion_length=8, eos_token_ids=[99])
    pool.add_groups([{"id": 0}, {"id": 0}], [[5], [5]], group_size=2)
    pool.apply(pool.unfinished(), [4, 4], [[1, 2, 3, 4], [1, 2, 3, 4]], [[-1.0] * 4] * 2, None, 0)
    saved = {"batches_handed": 1, "stream_position": 2, "pool": pool.state_dict(), "round": {"index": ("round", 1)}}
    if saves_settings:
        saved.update(sampled_under=SAMPLED, rounds={"partial_rollout_budget": 4, "partial_rollout_max_resumes": 3})
    change = dict(change)
    rounds = {"budget": change.pop("partial_rollout_budget", 4),
              "max_resumes": change.pop("partial_rollout_max_resumes", 3)}
    source = AsyncPartialRollout(port({**SAMPLED, **change}, **rounds))
    assert source.state_dict()["rounds"] == {"partial_rollout_budget": rounds["budget"],
                                             "partial_rollout_max_resumes": rounds["max_resumes"]}
    source.load_state_dict(saved)
    assert (source._restored_round is None) == regenerated
    assert source.state_dict().get("round") == (None if regenerated else saved["round"])  # re-saved before sending


@pytest.mark.slow  # 3 batches of 200 prompts on a server answering 2 s late: ~25 s
# The held push (TRL's NCCL path on CUDA) only: the pool is the same with the push handed over (the disk path), which
# has no hold bound to stay under.
@pytest.mark.parametrize("push", ["held"])
def test_a_generation_batch_above_the_old_request_pool_trains_within_a_short_timeout(push, tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """200 prompts per generation batch (TRL's pool sent 64 at a time: 4 waves) on a slowed stand-in answering each
    request 2 s late (concurrent requests overlap, as vLLM batches them), with a 4 s timeout: shorter than the batch in
    waves (about 9 s), and the producer's hold bound (1.5 x 4 = 6 s) too. Every request of a batch is in flight at
    once, so the run trains, with the push handed over (the disk path) or held between two requests (as TRL's NCCL
    push on CUDA; ``TRLPort.gather_weights`` patched to None, a STAND-IN for that path). With the pool capped at 64
    the held row raised ProducerStalled (the review's measurement)."""
    from bapo_trl.trainer.trl_port import TRLPort

    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    if push == "held":
        monkeypatch.setattr(TRLPort, "gather_weights", lambda self: None)
    server = PolicyServer(tiny_model_dir, latency=2.0)
    prompts, generations = 200, 2
    try:
        host, port = server.url.removeprefix("http://").split(":")
        args = cpu_config(
            tmp_path / "out", save_strategy="no", per_device_train_batch_size=prompts * generations // 4,
            steps_per_generation=4, num_generations=generations, max_completion_length=1, max_steps=8,
            logging_steps=1, seed=0, use_vllm=True, vllm_mode="server", vllm_server_host=host,
            vllm_server_port=int(port), vllm_server_timeout=4, async_generation=True, max_staleness=1)
        trainer = tiny_trainer(tiny_model_dir, args, model=tiny_model_dir, reward=completion_length, prompts=prompts)
        trainer.train()
    finally:
        server.close()
    assert trainer.state.global_step == 8
    assert server.most_in_flight >= prompts, server.most_in_flight  # a whole batch in flight at once, not waves
    assert not server.resent()


@pytest.mark.parametrize("chunking", [dict(async_generation=True, max_staleness=2, inflight_update_tokens=2),
                                      dict(partial_rollout_budget=3, partial_rollout_max_resumes=3)])
def test_ignore_eos_runs_every_chunked_completion_to_the_cap(chunking, tiny_model_dir, tmp_path, monkeypatch):
    """vLLM's ``ignore_eos`` generates past EOS to ``max_tokens``; chunked generation (in-flight chunks, partial
    rollout's rounds through TRL's vLLM generation) takes no EOS for a stop then, so every completion handed to TRL
    is as long as without chunks: ``max_completion_length`` (it ended at the first chunk holding an EOS before)."""
    from bapo_trl.trainer.trl_port import TRLPort

    lengths = []
    score = TRLPort.score_completions
    monkeypatch.setattr(TRLPort, "score_completions", lambda self, fn, rows, ready: lengths.extend(
        len(ids) for ids in ready.completion_ids) or score(self, fn, rows, ready))
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir)
    try:
        train_with_server(tiny_model_dir, tmp_path / "out", server.url, max_steps=3, reward=completion_length,
                          generation_kwargs={"ignore_eos": True}, **chunking)
    finally:
        server.close()
    assert lengths and set(lengths) == {8}, lengths


def test_a_stalled_server_is_an_error_naming_the_timeout(tiny_model_dir, tmp_path, monkeypatch):
    """The producer's request to a server that never answers surfaces in the trainer as the client's timeout error,
    sent once."""
    from bapo_trl.generation.http_client import VLLMServerTimeout

    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, stall_on=(1,))
    try:
        with pytest.raises(VLLMServerTimeout, match=r"did not answer /v1/completions within 2 s"):
            train_with_server(tiny_model_dir, tmp_path / "out", server.url, vllm_server_timeout=2,
                              async_generation=True)
    finally:
        server.close()
    assert server.requests["RPC", "reload_weights"] >= 1  # the weights were pushed before the first request
    # the first batch is one request per prompt (16 rows: 4 prompts of 4 completions); the first stalled; none sent
    # twice
    assert 1 <= server.requests["POST", "/v1/completions"] <= 4 and not server.resent()


# -- the real server ------------------------------------------------------------------------------------------------


class StepsOutlastTheRequestAhead(TrainerCallback):
    """Each optimizer step, on batch b, ends (before PolicySnapshots records its end) only once the request of batch
    b + ``ahead`` has started, as a real model's step outlasts the weight push before that request (a disk write and a
    server reload). The tiny model's step (~0.1 s) does not, and a fixed step length (1.5 s) was outrun by the push on
    a loaded machine; waiting for the event instead, the overlap tests check what the pipeline allows, not the
    machine's speed. Where the pipeline does not send that request during the step (a broken one), the step ends
    after ``patience`` seconds (once: the later steps no longer wait) and the overlap assertions fail."""

    def __init__(self, ahead: int = 1, patience: float = 120.0):
        self.ahead, self.patience = ahead, patience
        self.probe: AsyncProbe | None = None  # set by async_run
        self.waited_in_vain = False

    def on_step_end(self, args, state, control, **kwargs):
        wanted = state.global_step - 1 + self.ahead  # steps_per_generation = 1: step b trains on batch b
        if self.waited_in_vain or wanted >= state.max_steps:
            return
        with self.probe.started:
            self.waited_in_vain = not self.probe.started.wait_for(lambda: wanted in self.probe.requests,
                                                                  timeout=self.patience)


class AsyncProbe:
    """What a :class:`support.harness.Probe` records around the real source's methods (a probe, not a fake): each
    batch handed to the trainer and when each server request started."""

    def __init__(self):
        self.batches, self.requests = [], {}
        self.started = threading.Condition()  # notified as each request starts

    def around(self) -> dict:
        return {(AsyncGeneration, "next_batch"): self.recording_next_batch,
                (AsyncGeneration, "_generate"): self.recording_generate}

    def recording_next_batch(self, trainer, next_batch, inputs, score):
        output = next_batch(inputs, score)
        self.batches.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in output.items()})
        return output

    def recording_generate(self, trainer, generate, work):
        with self.started:
            self.requests[len(self.requests)] = time.perf_counter()  # requests run in batch order
            self.started.notify_all()
        return generate(work)


def probed(probe: AsyncProbe, resume_from=None, **kwargs):
    """A :class:`support.harness.Probe` recording into ``probe``, whose ``train()`` resumes from ``resume_from``;
    ``kwargs`` go to the trainer (``peft_config``, ``eval_dataset``)."""
    def train(trainer, real, *args, **kw):
        return real(resume_from_checkpoint=resume_from)

    return functools.partial(Probe, around={**probe.around(), "train": train}, **kwargs)


def async_run(model_dir, out, server_url, callbacks=(), resume_from=None, peft=None, **overrides):
    probe = AsyncProbe()
    for callback in callbacks:
        if isinstance(callback, StepsOutlastTheRequestAhead):
            callback.probe = probe
    trainer_cls = probed(probe, resume_from, **({"peft_config": peft} if peft is not None else {}))
    settings = dict(async_generation=True, steps_per_generation=1, learning_rate=5e-3, max_steps=6)
    trainer = train_with_server(model_dir, out, server_url, trainer_cls=trainer_cls, callbacks=callbacks,
                                **{**settings, **overrides})
    return trainer, probe


def completions_of(batch):
    """(prompt ids, completion ids, behaviour log-probs) of every completion of a recorded batch."""
    for i in range(batch["completion_ids"].size(0)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        length = int(batch["completion_mask"][i].sum())
        yield prompt, batch["completion_ids"][i][:length].tolist(), batch["old_per_token_logps"][i][:length]


@pytest.fixture(scope="module")
def async_k1(start_server, tiny_model_dir, tmp_path_factory):
    tiny_server = start_server(tiny_model_dir)
    reset_server_weights(tiny_server.url, tiny_model_dir)
    snapshots = PolicySnapshots()
    trainer, probe = async_run(tiny_model_dir, tmp_path_factory.mktemp("async") / "out", tiny_server.url,
                               callbacks=[StepsOutlastTheRequestAhead(ahead=1), snapshots])
    return trainer, probe, snapshots


@pytest.mark.slow
def test_generation_of_the_next_batch_overlaps_training_on_this_one(async_k1):
    trainer, probe, snapshots = async_k1
    assert len(probe.batches) == 6
    # K=1: request b+1 is sent while the step on batch b is still training; every time: the steps last until it has
    # started (StepsOutlastTheRequestAhead), which only a pipeline that sends it during the step lets happen
    overlapped = [b for b in range(5) if probe.requests[b + 1] < snapshots.step_ends[b]]
    assert overlapped == [0, 1, 2, 3, 4], (probe.requests, snapshots.step_ends)
    logs = [h for h in trainer.state.log_history if "async/wait_seconds" in h]
    assert len(logs) == 6
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


@pytest.mark.slow
def test_staleness_never_exceeds_max_staleness(async_k1):
    trainer, probe, _ = async_k1
    versions = [int(b["policy_version"][0]) for b in probe.batches]
    assert versions[0] == 0
    ages = [step - v for step, v in enumerate(versions)]  # one optimizer step per generation batch here
    assert max(ages) <= 1 and ages[1:] == [1] * 5  # K=1, and generation always ran one batch ahead
    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    assert max(h["async/staleness_max"] for h in logs) == 1 and max(h["bapo/staleness_max"] for h in logs) == 1
    assert all(h["bapo/token_fraction/age_1"] == 1 for h in logs[1:])


@pytest.mark.slow
def test_behaviour_logps_are_those_of_the_saved_sampling_policy(async_k1, tiny_model_dir):
    """Each batch's old_per_token_logps equal a recomputation with the policy of the version the batch carries
    (saved at that step), and differ from the current policy's: the staleness reaches BAPO."""
    trainer, probe, snapshots = async_k1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    checked, gap = 0, 0.0
    for step, batch in enumerate(probe.batches[1:], start=1):
        version = int(batch["policy_version"][0])
        for prompt, completion, behaviour in list(completions_of(batch))[:4]:
            gap = max(gap, check_behaviour_logps(model, snapshots.policies, prompt, completion, version, behaviour,
                                                 atol=1e-3, temperature=trainer.temperature, newest=step))
            checked += 1
    print(f"largest current-policy gap: {gap:.3f}")
    assert checked >= 16 and gap > 1e-2


@pytest.mark.slow
def test_every_async_metric_is_registered_and_logged(async_k1):
    from bapo_trl.core.metrics import REGISTRY

    trainer, _, _ = async_k1
    logged = {k for h in trainer.state.log_history for k in h if k.startswith(("async/", "bapo/"))}
    registered = {name for names in REGISTRY.values() for name in names}
    assert logged <= registered, logged - registered
    assert set(REGISTRY["async"]) <= logged, set(REGISTRY["async"]) - logged


@pytest.mark.slow
def test_k2_runs_up_to_two_batches_ahead_and_no_further(tiny_server, tiny_model_dir, tmp_path):
    reset_server_weights(tiny_server.url, tiny_model_dir)
    snapshots = PolicySnapshots()
    # each step lasts until request b+2 has started or 120 s have passed (StepsOutlastTheRequestAhead): on the tiny
    # model a bare step is shorter than the pushes before it
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url,
                               callbacks=[StepsOutlastTheRequestAhead(ahead=2), snapshots], max_staleness=2)
    ages = [step - int(b["policy_version"][0]) for step, b in enumerate(probe.batches)]
    assert max(ages) <= 2, ages
    # Pacing: request b+2 is queued when the step on batch b begins (after step b-1 ended), never earlier ...
    for b in range(1, len(probe.batches) - 2):
        assert probe.requests[b + 2] > snapshots.step_ends[b - 1]
    # ... and it does run while batch b trains (impossible at K=1, where b+2 waits for the step on b+1), every time
    ahead = [b for b in range(len(probe.batches) - 2) if probe.requests[b + 2] < snapshots.step_ends[b]]
    assert ahead == list(range(len(probe.batches) - 2)), (probe.requests, snapshots.step_ends)


class GenerationTheSlowerSide:
    """Generation the slower side, by construction instead of by a slowed server: the request of batch b is sent only
    once the trainer waits for batch b (``Producer.take``), so the trainer has handed over every push it makes before
    it needs that batch, whatever the machine's speed (a STAND-IN for a server slower than training, deterministic:
    a server slowed per token made the same point only while generation stayed slower than a training step on a
    loaded machine). Requests queued ahead that the trainer never takes are refused at the end, not sent."""

    def __init__(self, monkeypatch):
        self.condition, self.taken, self.ended = threading.Condition(), set(), False
        take, generate = Producer.take, AsyncGeneration._generate

        def taking(producer, index):
            with self.condition:
                self.taken.add(index)
                self.condition.notify_all()
            return take(producer, index)

        def sent_once_taken(source, work):
            with self.condition:  # the bound only turns a hang into an error
                assert self.condition.wait_for(lambda: work.index in self.taken or self.ended, timeout=300)
                if work.index not in self.taken:
                    raise RuntimeError(f"batch {work.index} was queued ahead and never taken: not sent")
            return generate(source, work)

        close = Producer.close

        def closing(producer):  # the run has ended: what is queued ahead is never taken (its request waited in vain
            self.end()          # for the close's request bound, ~25 s)
            return close(producer)

        monkeypatch.setattr(Producer, "take", taking)
        monkeypatch.setattr(AsyncGeneration, "_generate", sent_once_taken)
        monkeypatch.setattr(Producer, "close", closing)

    def end(self):
        with self.condition:
            self.ended = True
            self.condition.notify_all()


def test_lazy_loading_lets_a_slower_server_skip_reloads_within_the_bound(tiny_model_dir, tmp_path, monkeypatch):
    """Generation the slower side, K=2: eagerly the server would reload before every request and the data stay one
    push old (benchmarks/async_overlap.py measured that); lazily it skips the reloads the bound does not need, so
    requests run on weights up to two pushes old, never older (age at hand-over <= 2).

    Deterministic (:class:`GenerationTheSlowerSide`): when batch b+1 starts, the trainer waits for batch b, so the
    pushes of steps 0..b have been handed over; batch b+1 was queued at step b-1 and needs weights >= b-1. Lazily,
    the server holding such weights generates it without a load, else it loads the newest push (b): batches 0-2 run on
    push 0, batch 3 loads push 2, batch 4 keeps it, batch 5 loads push 4, ... The ages at hand-over are 0, 1, 2, then
    1, 2 in turn; 5 reloads for 10 batches (eagerly: 10, every age 1)."""
    gate = GenerationTheSlowerSide(monkeypatch)
    server = PolicyServer(tiny_model_dir)
    try:
        trainer = train_with_server(tiny_model_dir, tmp_path, server.url, max_steps=10, async_generation=True,
                                    max_staleness=2, steps_per_generation=1, lazy_weight_loading=True,
                                    disable_tqdm=True)
    finally:
        gate.end()
        server.close()
    ages = [h["async/staleness_max"] for h in trainer.state.log_history if "async/staleness_max" in h]
    assert len(ages) == 10 and max(ages) <= 2, ages
    requests = len(server.versions)
    assert server.reloads < requests - 1, (server.reloads, server.versions)  # loads were skipped ...
    assert ages.count(2) >= 2, ages  # ... so batches reached the bound
    # exactly as derived above (a batch is 2 requests: 2 prompts, one seeded request each)
    per_batch = [1, 1, 1, 2, 2, 3, 3, 4, 4, 5]  # reloads applied when each batch's requests ran
    assert ages == [0, 1, 2] + [1, 2] * 3 + [1] and server.reloads == 5, (ages, server.reloads)
    assert server.versions == [v for v in per_batch for _ in range(2)], server.versions
    loads = [h["async/load_seconds"] for h in trainer.state.log_history if "async/load_seconds" in h]
    assert 0 < sum(s > 0 for s in loads) < len(loads), loads  # hand-overs with a load since the last, and without
    # the push lag at generation, apart from the age at hand-over: batch b's request starts while the trainer ends
    # step b - 1 or has just ended it (a race the lag reports as it is), on the weights above (0, 0, 0, 2, 2, 4, ...):
    # never more than the age at hand-over, which counts the steps trained since; below it where a batch waited
    # (batch 2: weights 0, started by step 1, handed over at step 2), and at least one step where loads were skipped
    lags = [h["bapo/weight_sync_lag"] for h in trainer.state.log_history if "bapo/weight_sync_lag" in h]
    assert len(lags) == 10 and all(0 <= lag <= age for lag, age in zip(lags, ages)), (lags, ages)
    assert lags[2] < ages[2] and max(lags) >= 1, (lags, ages)


@pytest.mark.slow
def test_resume_trains_the_remaining_batches_once(tiny_server, tiny_model_dir, tmp_path):
    """A run checkpointed after 2 of 4 batches resumes with batches 3 and 4 of the same prompt stream: the batch
    generated ahead at the checkpoint is saved and trained as it was (same completions, same policy version), not
    generated again; the union of prompts equals the uninterrupted run's."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "out"
    full, full_probe = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, save_strategy="steps",
                                 save_steps=2)
    state = torch.load(out / "checkpoint-2" / "async_generation_rank0.pt", weights_only=False)
    assert state["batches_handed"] == 2
    assert [g["index"] for g in state["generated"]] == [2]  # K=1: the batch generated ahead of step 3
    _, probe = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, resume_from=str(out / "checkpoint-2"))
    assert len(probe.batches) == 2  # only the two batches after the checkpoint

    def prompts(batch):
        return [tuple(p) for p, _, _ in completions_of(batch)]

    assert [prompts(b) for b in probe.batches] == [prompts(b) for b in full_probe.batches[2:]]
    saved, uninterrupted = probe.batches[0], full_probe.batches[2]
    assert [c for _, c, _ in completions_of(saved)] == [c for _, c, _ in completions_of(uninterrupted)]
    assert int(saved["policy_version"][0]) == int(uninterrupted["policy_version"][0]) == 1


@pytest.mark.slow
def test_lora_with_async_generation(tiny_server, tiny_model_dir, tmp_path):
    """LoRA with ``vllm_lora_sync="merged"`` (the fallback to TRL's merged push, on a server without LoRA): the merged
    weights are pushed, and the behaviour log-probs still match the server's sampling policy (TRL's sampler comparison
    is 0 by construction, so the staleness metrics and a finite loss are what is checked; the push of merged weights is
    TRL's own code). The adapter push, the default, is checked in test_lora_real_server.py and the matrix's LoRA
    rows."""
    from peft import LoraConfig

    reset_server_weights(tiny_server.url, tiny_model_dir)
    steps = StepsOutlastTheRequestAhead(ahead=1)
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, max_steps=4, callbacks=[steps],
                               peft=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                               vllm_lora_sync="merged")
    assert len(probe.batches) == 4 and not steps.waited_in_vain  # each next request started during a step
    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    staleness = [h["async/staleness_max"] for h in logs]
    # K=1: the first batch is fresh, none older than one step; the next batch is generated during a step (each step
    # lasts until it has started, StepsOutlastTheRequestAhead: with a fixed 1.5 s step, on a loaded machine a step
    # ended before the merged weights' push, and a batch came fresh)
    assert staleness[0] == 0 and max(staleness) == 1 and all(s in (0, 1) for s in staleness), staleness
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


@pytest.mark.slow
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial_rollout"])
def test_zero3_two_processes_async_from_train_bapo(tiny_server, tiny_model_dir, tmp_path, partial):
    """`accelerate launch` ZeRO-3 on 2 processes: every rank takes part in each push (gathering is collective),
    rank 0's producer alone talks to the server, and each rank trains its slice of the shared batch (with partial
    rollout: of the finished groups of rank 0's pool). Without partial rollout it also evaluates every 2 steps:
    TRL's own generation on every rank with rank 0's producer held, through the hold's per-batch broadcast (the
    weights each queued batch keeps are checked by the guarantees matrix's evaluating row, on a server slow
    enough to queue them)."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "run"
    extra = ["--partial_rollout_budget", "3", "--max_completion_length", "10"] if partial else \
        ["--max_completion_length", "8", "--eval_strategy", "steps", "--eval_steps", "2"]
    text, staleness = zero3_async_from_train_bapo(tiny_server.url, out, *extra)
    from support.run_logs import logged, training_steps, values

    if not partial:
        assert staleness == [0, 1, 1, 1], staleness
        assert len([e for e in logged(out) if "eval_loss" in e]) == 2
    else:
        segments = values(out, "partial/segments_per_completion")
        assert len(segments) == 4 and max(segments) > 1, segments
    assert training_steps(out) == [1, 2, 3, 4], text[-3000:]


@pytest.mark.slow
def test_dynamics_plot_draws_the_async_panels_from_a_real_async_run(async_k1):
    from bapo_trl.reporting.dynamics import plot_dynamics

    trainer, _, _ = async_k1
    history = trainer.state.log_history
    fig = plot_dynamics(history, smooth=1)
    assert {"async_time", "async_age"} <= set(fig.bapo_panels)
    drawn = {ln.get_gid(): ln for ln in fig.bapo_axes["async_time"].lines}
    logged = [h["async/generate_seconds"] for h in history if "async/generate_seconds" in h]
    assert list(drawn["async/generate_seconds"].get_ydata()) == pytest.approx(logged)
    assert "async_time" not in plot_dynamics([{"reward": 0.5, "step": 1}], smooth=1).bapo_panels


@pytest.mark.slow
def test_evaluation_during_async_training_holds_the_producer_and_records_its_push(tiny_server, tiny_model_dir,
                                                                                  tmp_path):
    """Evaluation generates through TRL's own path with the producer held; TRL's push of the current weights is
    recorded, so the batches generated after it carry that version (never an older one: staleness stays <= K)."""
    from bapo_trl.recipes.toy import make_reverse_dataset

    reset_server_weights(tiny_server.url, tiny_model_dir)

    probe = AsyncProbe()
    with_eval = probed(probe, eval_dataset=make_reverse_dataset(8, seed=5))
    trainer = train_with_server(tiny_model_dir, tmp_path, tiny_server.url, trainer_cls=with_eval,
                                async_generation=True, steps_per_generation=1, learning_rate=5e-3, max_steps=5,
                                eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) >= 2 and all(torch.isfinite(torch.tensor(h["eval_loss"])) for h in evals)
    versions = [int(b["policy_version"][0]) for b in probe.batches]
    assert len(versions) == 5 and all(0 <= step - v <= 1 for step, v in enumerate(versions)), versions
    # one push per distinct policy: an evaluation's push is recorded, so the batch at that step does not push again
    pushed_steps = set(range(5)) | {h["step"] for h in evals}
    assert trainer.vllm_generation.disk_sync.num_syncs == len(pushed_steps), pushed_steps


@pytest.mark.slow
def test_partial_rollout_grows_completions_across_async_rounds(tiny_server, tiny_model_dir, tmp_path):
    """Each round the server grows the unfinished completions by the budget while the trainer trains; completions
    span several rounds and policies, and every token's behaviour log-prob is that of the policy of its version
    (recomputed with the saved policy), which the newest policy no longer matches."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    snapshots = PolicySnapshots()
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, callbacks=[snapshots], max_steps=6,
                               partial_rollout_budget=3, partial_rollout_max_resumes=3, max_completion_length=10,
                               per_device_train_batch_size=16, seed=1,
                               reward=completion_length)  # dense: every step moves the policy
    logs = [h for h in trainer.state.log_history if "partial/segments_per_completion" in h]
    assert len(logs) == 6 and max(h["partial/segments_per_completion"] for h in logs) > 1.5
    # the push lag of every round's request (issue 75, finding 8: it was None at every step here)
    assert all(isinstance(h.get("bapo/weight_sync_lag"), (int, float)) and h["bapo/weight_sync_lag"] >= 0
               for h in logs), [h.get("bapo/weight_sync_lag") for h in logs]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    checked, gap = set(), 0.0
    for step, batch in enumerate(probe.batches):
        for i, (prompt, completion, behaviour) in enumerate(completions_of(batch)):
            versions = batch["token_policy_version"][i][: len(completion)]
            if len(set(versions.tolist())) < 2:
                continue
            assert int(versions.max()) < step + 1 and step - int(versions.min()) <= 4  # <= max_resumes + 1 rounds
            gap = max(gap, check_behaviour_logps(model, snapshots.policies, prompt, completion, versions, behaviour,
                                                 atol=1e-3, temperature=trainer.temperature, newest=step))
            checked |= set(versions.tolist())
    print(f"versions checked: {sorted(checked)}; largest newest-policy gap on older segments: {gap:.3f}")
    assert len(checked) >= 2 and gap > 1e-2


@pytest.mark.slow
def test_partial_rollout_resume_continues_the_saved_pool(tiny_server, tiny_model_dir, tmp_path):
    """The pool (unfinished completions with their tokens) and the prompt stream's position are in the checkpoint:
    the resumed run trains groups that were in flight at the checkpoint, and none that trained before it."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "out"
    partial = dict(partial_rollout_budget=3, partial_rollout_max_resumes=3, max_completion_length=10,
                   per_device_train_batch_size=16, seed=1)
    _, full = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, save_strategy="steps", save_steps=2,
                        **partial)
    state = torch.load(out / "checkpoint-2" / "async_generation_rank0.pt", weights_only=False)
    assert state["batches_handed"] == 2 and state["stream_position"] >= 3 and state["pool"]["groups"]
    in_flight = {tuple(c["prompt_ids"]) for g in state["pool"]["groups"] for c in g["completions"]}
    _, resumed = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, resume_from=str(out / "checkpoint-2"),
                           **partial)
    assert len(resumed.batches) == 2

    def prompts(batches):
        return {tuple(p) for b in batches for p, _, _ in completions_of(b)}

    after = prompts(resumed.batches)
    # the first batch after the resume is made of the oldest groups in flight at the checkpoint (measured: 8 of the
    # 8 prompts of both resumed batches come from the saved pool; with the pool dropped, 1 of 8, by coincidence)
    assert prompts(resumed.batches[:1]) <= in_flight
    assert len(after & in_flight) > len(after) // 2
    assert not after & prompts(full.batches[:2])  # nothing trained twice


@pytest.mark.slow
def test_weight_sync_steps_pushes_every_nth_step(tiny_server, tiny_model_dir, tmp_path):
    reset_server_weights(tiny_server.url, tiny_model_dir)
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, max_steps=6, weight_sync_steps=2)
    assert trainer.vllm_generation.disk_sync.num_syncs == 3  # at steps 0, 2 and 4
    versions = [int(b["policy_version"][0]) for b in probe.batches]
    assert set(versions) <= {0, 2, 4} and max(step - v for step, v in enumerate(versions)) == 2, versions


@pytest.mark.slow
# A later batch: the request is sent while both ranks train. A stall of the first batch's
# request (rank 1 waiting at the first hand-over's broadcast) ran here too until CI's time budget (~20 s a launch);
# on one process it is the fast test_a_stalled_server_is_an_error_naming_the_timeout.
@pytest.mark.parametrize("stalled", [2], ids=["later batch"])
def test_a_stalled_server_ends_every_process_of_a_two_process_run(stalled, tmp_path):
    """2 processes; the stand-in server (tests/support/policy_server.py) answers the first two batches and stalls on
    the third (sent while step 1 trains): rank 0's request times out, and
    both ranks end with the error at the next hand-over (rank 1 through the broadcast), before either enters the weight
    push's collectives. A batch is 4 requests here (2 x 8 rows / 4 completions: one seeded request per prompt)."""
    from bapo_trl.recipes.toy import build_tiny_model
    from support.launching import REPO, accelerate_launch
    from support.policy_server import PolicyServer

    prompts_per_batch = 4
    server = PolicyServer(build_tiny_model(), stall_on=(stalled * prompts_per_batch + 1,))  # the embedded model
    try:
        with pytest.raises(AssertionError) as failed:
            accelerate_launch(
                REPO / "train_bapo.py", "--max_steps", "4", "--per_device_train_batch_size", "8",
                "--num_generations", "4", "--max_completion_length", "8", "--steps_per_generation", "1",
                "--output_dir", tmp_path / "run", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
                server.url, "--vllm_server_timeout", "3", "--async_generation", timeout=600,
                env={"BAPO_VLLM_WEIGHTS_DIR": str(tmp_path)})
    finally:
        server.close()
    text = str(failed.value)
    assert "did not answer /v1/completions within 3 s" in text
    assert "async generation failed on the main process: VLLMServerTimeout" in text  # rank 1's error
    sent = server.requests["POST", "/v1/completions"]
    assert stalled * prompts_per_batch < sent <= (stalled + 1) * prompts_per_batch and not server.resent(), sent


def test_the_trainer_feeds_the_servers_answers_to_the_producers_stall_bound(tiny_model_dir, tmp_path, monkeypatch):
    """Wiring, through a trainer: the producer's stall bound restarts at every answer of the server (a batch of
    in-flight updates is 12 requests one after another, together longer than one bound), because the trainer hands
    the producer the port's count of answered requests as its progress. Proved without a wall-clock budget: the
    producer the run builds reads exactly that count, which moved once per request the server answered. (That a
    moving progress restarts the bound is the producer's own test, on a scripted clock:
    test_a_large_batch_answered_request_by_request_is_not_a_stall.)"""
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    built, init = [], Producer.__init__

    def recording_init(self, *args, **kwargs):  # the real constructor; the producer kept for the check
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Producer, "__init__", recording_init)
    server = PolicyServer(tiny_model_dir)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        args = cpu_config(
            tmp_path / "out", save_strategy="no", per_device_train_batch_size=4, steps_per_generation=1,
            num_generations=2, max_completion_length=12, max_steps=1, logging_steps=1, seed=0, use_vllm=True,
            vllm_mode="server", vllm_server_host=host, vllm_server_port=int(port), vllm_server_timeout=30,
            async_generation=True, max_staleness=1, inflight_update_tokens=1, generation_kwargs={"ignore_eos": True})
        trainer = tiny_trainer(tiny_model_dir, args, reward=completion_length, prompts=8)
        trainer.train()
    finally:
        server.close()
    assert trainer.state.global_step == 1 and len(built) == 1
    producer = built[0]
    assert producer.progress == trainer.port.requests_answered  # the port's count, not the default (no progress)
    answered = server.requests["POST", "/v1/completions"]
    assert answered >= 12 and producer.progress() == answered  # it moved with every answer
