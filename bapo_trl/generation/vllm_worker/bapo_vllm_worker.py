"""A vLLM worker extension (``--worker-extension-cls bapo_vllm_worker.BAPOWorkerExtension``).

Why: after ``reload_weights`` vLLM's CPU backend re-packs every layer it reloaded, but a tied output layer
(``lm_head`` sharing the embedding matrix) loads no tensor of its own, so it keeps the GEMM weights pre-packed from
the OLD embedding and the server samples from a stale head. ``bapo_refresh_output_layers`` re-runs the post-load
processing of the vocabulary layers against their current weights. Harmless on untied models and on GPU.
``bapo_weights_mark`` keeps the name of the weights the trainer pushed last, so that the trainer can see that a
server restarted (its workers hold none) and push them again. ``bapo_read_probe`` reads back the small file the
trainer writes at start, to check that the server sees the trainer's weight directory (another machine needs a
shared mount). Imported by the server only: stdlib, torch and vLLM.
"""

from __future__ import annotations


class BAPOWorkerExtension:
    """Mixed into vLLM's worker class by vLLM; methods are callable through ``POST /collective_rpc``."""

    def bapo_refresh_output_layers(self) -> int:
        """Re-derive kernel-side copies (CPU pre-packed GEMM) of embedding / LM-head layers; returns how many."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.get_model()
        refreshed = 0
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(module, VocabParallelEmbedding) or method is None:
                continue
            if not hasattr(module, "cpu_linear"):  # not on the CPU backend, or never used as a linear layer
                continue
            method.process_weights_after_loading(module)
            refreshed += 1
        return refreshed

    def bapo_weights_mark(self, name: str | None = None) -> str | None:
        """The name of the weight directory this worker loaded last, as the trainer left it after the load (``name``:
        leave it). None in a worker started since (a restarted server holds its checkpoint's weights): the trainer
        then has it load the last pushed weights again before its next request."""
        if name is not None:
            self._bapo_weights_mark = name
        return getattr(self, "_bapo_weights_mark", None)

    def bapo_read_probe(self, path: str) -> dict:
        """The content of ``path`` as this worker sees it (the trainer's start-up check of a shared weight
        directory), or the error reading it; with this worker's host name."""
        import socket

        try:
            with open(path) as f:
                return {"content": f.read(), "error": None, "host": socket.gethostname()}
        except OSError as exc:
            return {"content": None, "error": f"{type(exc).__name__}: {exc}", "host": socket.gethostname()}
