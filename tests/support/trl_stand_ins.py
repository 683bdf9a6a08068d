"""STAND-INS for what TRL's own weight push talks to on CUDA, where these machines cannot run it: its vLLM client
(NCCL to the server) and the colocated engine (vLLM's sleep mode). Each takes part in the push as TRL's code calls
it and fails where it is told to, so the push's error handling runs without NCCL or a GPU."""

from __future__ import annotations


class StandInClient:
    """TRL's client as the push sees it: it streams the walk (``update_named_params``), raising ``error`` (default:
    a lost server's ``ConnectionError``) once ``stop_after`` weights have gone, and resets the prefix cache
    (``reset_fails``: that fails instead). A generation request raises ``error``."""

    def __init__(self, stop_after: int | None = None, reset_fails: bool = False,
                 error: BaseException | None = None):
        self.stop_after, self.reset_fails, self.received = stop_after, reset_fails, 0
        self.error = error or ConnectionError("the server is gone (stand-in)")

    def update_named_params(self, metadata, named_params):
        for _ in named_params:
            if self.received == self.stop_after:
                raise self.error
            self.received += 1

    def reset_prefix_cache(self):
        if self.reset_fails:
            raise ConnectionError("the prefix-cache reset failed (stand-in)")

    def generate(self, **kwargs):
        raise self.error  # a generation request: the server is gone


class HoldingClient(StandInClient):
    """A client that reads what the walk yields only once the walk has ended, as vLLM's packed NCCL transfer does with
    its last chunk (``pack_tensors`` keeps views, concatenated after the iterator's end): ``values`` holds what it
    read then."""

    def update_named_params(self, metadata, named_params):
        held = list(named_params)
        self.values = {name: tensor.clone() for name, tensor in held}


class StandInEngine:
    """The colocated engine as TRL's push sees it (vLLM's sleep mode on): woken up (``wake_fails``: that fails), then
    each weight loaded; or, as the CPU reload sees it, a directory reloaded (``collective_rpc``; ``reload_fails``: that
    fails)."""

    def __init__(self, wake_fails: bool = False, reload_fails: bool = False):
        self.wake_fails, self.reload_fails, self.loaded = wake_fails, reload_fails, 0
        runner = type("Runner", (), {"model": self})()
        self.llm_engine = type("Engine", (), {"model_executor": type("Executor", (), {
            "driver_worker": type("Worker", (), {"model_runner": runner})()})()})()

    def wake_up(self, tags):
        if self.wake_fails:
            raise RuntimeError("the engine could not wake up (stand-in)")

    def load_weights(self, weights):
        self.loaded += len(weights)

    def reset_prefix_cache(self):
        pass

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights" and self.reload_fails:
            raise RuntimeError("the engine could not reload the weights (stand-in)")
        return []
