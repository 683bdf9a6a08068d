"""The async machinery, with no knowledge of models or trainers: the prompt stream and the producer thread.

* :class:`PromptStream`: global generation batches of dataset indices in the order TRL's ``RepeatSampler`` draws
  them, restartable at any batch;
* :class:`Producer`: one thread that takes queued :class:`Work` in order, makes one request per piece of work
  (``generate``, given by the source) and keeps the results until they are taken. A weight push either runs between
  two requests while the trainer waits (:meth:`Producer.between_requests`), or is handed over and applied by this
  thread before its next request, the trainer going on at once (:meth:`Producer.push_later`); with in-flight updates
  a request in chunks applies it between two chunks (:meth:`Producer.between_chunks`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from trl.trainer.utils import RepeatSampler


class PromptStream:
    """Global generation batches of dataset indices, in the order TRL's ``RepeatSampler`` draws them (same seed:
    a group's ``num_generations`` copies side by side, a new permutation every epoch); restartable at batch ``n``."""

    def __init__(self, num_rows: int, num_generations: int, batch_rows: int, shuffle: bool, seed: int):
        if batch_rows % num_generations or num_rows * num_generations < batch_rows:
            raise ValueError(f"a generation batch of {batch_rows} rows needs whole groups of {num_generations} "
                             f"from a train set of {num_rows} prompts")
        self.sampler = RepeatSampler(range(num_rows), mini_repeat_count=num_generations,
                                     batch_size=batch_rows // num_generations, shuffle=shuffle, seed=seed)
        self.batch_rows = batch_rows
        self.position = 0  # batches drawn so far
        self._iterator = self._batches()

    def _batches(self):
        while True:  # one pass of the sampler per epoch; its generator draws a new permutation each time
            indices = list(self.sampler)
            for start in range(0, len(indices) - self.batch_rows + 1, self.batch_rows):
                yield indices[start : start + self.batch_rows]

    def next(self) -> list[int]:
        self.position += 1
        return next(self._iterator)

    def skip_to(self, position: int) -> None:
        while self.position < position:
            self.next()


@dataclass
class Work:
    """One request: ``n`` completions of every prompt (token ids), at most ``max_tokens`` each, sampled with ``seed``
    (the same request on the same weights samples the same completions); ``context`` is the caller's (dataset rows,
    or the completions a round continues)."""

    index: Any
    prompts: list[list[int]]
    n: int
    max_tokens: int
    context: Any = None
    seed: int | None = None


@dataclass
class GeneratedBatch:
    """What the server returned for one piece of work (one entry per completion, prompt-major)."""

    work: Work
    completion_ids: list[list[int]]
    logps: list[list[float]]  # the sampler's log-prob of each token
    version: int  # optimizer step of the weights the server held when the request started
    seconds: float  # time of the generate request
    token_versions: list[list[int]] | None = None  # per token, when a push reached the request in flight

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [p for p in self.work.prompts for _ in range(self.work.n)]


class ProducerStalled(TimeoutError):
    """The generation thread did not finish a request within its bound (the server stalled or died)."""


class Producer:
    """The generation thread of the main process: takes queued work in order, sends one request per piece of work,
    keeps the results until they are taken. A weight push runs between two requests (:meth:`between_requests`).

    Every wait of the trainer on this thread is bounded, whatever the HTTP client does (TRL's own client on CUDA
    retries and sets no read timeout): waiting for the request in flight by ``1.5 x request_timeout``, waiting for a
    batch by ``3.5 x request_timeout`` (the request in flight, a finishing request, the batch's own, and slack). A
    stall is then a :class:`ProducerStalled` error, never a hang."""

    def __init__(self, generate: Callable[[Work], dict], request_timeout: float):
        self.generate, self.request_timeout = generate, request_timeout
        self.version = 0  # optimizer step of the weights on the server (set under the lock by the pusher)
        self.work: queue.Queue[Work | None] = queue.Queue()
        self.ready: dict[Any, GeneratedBatch] = {}
        self.error: BaseException | None = None
        self.condition = threading.Condition()
        self.in_flight: Any = None  # index of the work being requested
        self.applied_push_seconds = 0.0  # time this thread spent applying pushes handed over (since last read)
        self._pending: tuple[Callable[[], None], int] | None = None  # a push handed over, not applied yet
        self._request_lock = threading.Lock()  # held for each request; a push takes it between two
        self._push_wanted = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="bapo-async-generation", daemon=True)
        self._thread.start()

    @property
    def hold_bound(self) -> float:
        """Longest wait for the request in flight to end."""
        return 1.5 * self.request_timeout

    @property
    def batch_bound(self) -> float:
        """Longest wait for one batch."""
        return 3.5 * self.request_timeout

    def submit(self, work: Work) -> None:
        self.work.put(work)

    def preload(self, batches: dict[Any, GeneratedBatch]) -> None:
        """Batches generated before a checkpoint, handed out as if this thread had just generated them."""
        with self.condition:
            self.ready.update(batches)
            self.condition.notify_all()

    def push_later(self, push: Callable[[], None], version: int) -> None:
        """Hand over a push (``push()`` loads weights of optimizer step ``version`` into the server): this thread applies
        it before its next request or chunk, so the trainer never waits for a request in flight. A newer push replaces
        one not yet applied (the server needs only the newest weights)."""
        with self.condition:
            self._pending = (push, version)

    def apply_pending(self) -> None:
        """Apply a push handed over, now (the caller holds the request lock: this thread, or a holder of
        :meth:`between_requests`). A failure is raised to the caller."""
        with self.condition:
            pending, self._pending = self._pending, None
        if pending is not None:
            push, version = pending
            start = time.perf_counter()
            push()
            self.version = version
            self.applied_push_seconds += time.perf_counter() - start

    def between_chunks(self) -> int:
        """This thread, inside a request made in chunks: let a waiting push run, apply one handed over, and return the
        version the next chunk is generated by."""
        self._request_lock.release()
        try:
            with self.condition:  # a waiting push goes first
                while self._push_wanted.is_set():
                    self.condition.wait(timeout=1.0)
        finally:
            self._request_lock.acquire()
        self.apply_pending()
        return self.version

    @contextlib.contextmanager
    def between_requests(self):
        """Hold the producer between two requests (a request in flight finishes first, within :attr:`hold_bound`)."""
        self._push_wanted.set()
        try:
            if not self._request_lock.acquire(timeout=self.hold_bound):
                raise ProducerStalled(
                    f"async generation: the request for batch {self.in_flight!r} did not end within "
                    f"{self.hold_bound:.0f} s (1.5 x vllm_server_timeout): the vLLM server is stalled or gone")
            try:
                yield self
            finally:
                self._request_lock.release()
        finally:
            self._push_wanted.clear()
            with self.condition:
                self.condition.notify_all()

    def take(self, index) -> tuple[GeneratedBatch, float]:
        """Batch ``index`` (removed) and the seconds waited for it; the producer's error if it failed."""
        return self._wait(index, pop=True)

    def wait_for(self, index) -> GeneratedBatch:
        """Batch ``index``, left in place (for a checkpoint of the batches generated ahead)."""
        return self._wait(index, pop=False)[0]

    def _wait(self, index, pop: bool) -> tuple[GeneratedBatch, float]:
        start = time.perf_counter()
        deadline = start + self.batch_bound
        with self.condition:
            while index not in self.ready and self.error is None:
                if not self._thread.is_alive():
                    raise RuntimeError("async generation: the producer thread is gone")
                if not self.condition.wait(timeout=min(5.0, max(deadline - time.perf_counter(), 0.01))) and \
                        time.perf_counter() > deadline:
                    raise ProducerStalled(f"async generation: batch {index!r} not generated within "
                                          f"{deadline - start:.0f} s (3.5 x vllm_server_timeout)")
            if self.error is not None:
                raise self.error
            batch = self.ready.pop(index) if pop else self.ready[index]
            return batch, time.perf_counter() - start

    def depth(self) -> int:
        with self.condition:
            return len(self.ready)

    def close(self) -> None:
        self._closed = True
        self.work.put(None)
        self._thread.join(timeout=1.0)  # a request in flight ends within its timeout; the thread is a daemon

    def _run(self) -> None:
        try:
            while True:
                work = self.work.get()
                if work is None or self._closed:
                    return
                with self.condition:  # a waiting push goes first (the lock alone is not fair)
                    while self._push_wanted.is_set():
                        self.condition.wait(timeout=1.0)
                with self._request_lock:
                    self.apply_pending()
                    version, start, self.in_flight = self.version, time.perf_counter(), work.index
                    output = self.generate(work)
                    seconds = time.perf_counter() - start
                    self.in_flight = None
                batch = GeneratedBatch(work, output["completion_ids"], output["logps"], version, seconds,
                                       output.get("versions"))
                with self.condition:
                    self.ready[work.index] = batch
                    self.condition.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, raised on every process
            with self.condition:
                self.error = exc
                self.condition.notify_all()
