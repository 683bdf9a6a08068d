"""A STAND-IN for the vLLM server, for the fast tier: a thread serving the few HTTP endpoints the trainer uses, that
really samples from the policy it holds (a transformers model on CPU) and really reloads the weights the trainer
pushes through the disk.

Why a stand-in: the real vLLM CPU server takes a minute to start and about 3 GiB, so the guarantees matrix runs its
async rows against it only in the slow tier. What this stand-in shares with the real one is exactly what those rows
check: each completion is sampled by the policy the server held when the request ran, and each token's log-prob is
that policy's (temperature-scaled, as vLLM's ``processed_logprobs``), so "behaviour log-probs = a recomputation
with the saved sampling policy" and "staleness <= K" are checked for real. What it does not share: vLLM's kernels,
batching, prefix cache and sampling settings other than temperature (it refuses them). ``perturb`` > 0 makes its
policy differ from the trainer's on purpose (as a real engine's kernels or quantisation make it differ).

A request's ``seed`` is applied as vLLM applies it: every prompt of the request is sampled from a generator seeded
``seed`` (its child j: ``seed + j``), so identical prompts in one seeded request get identical completions, exactly
as on the real server (tests/test_request_seeds.py checks that on a real one). It can stall on chosen requests
(``stall_on``: the n-th generate request is accepted and never answered), to test that a stalled server ends training
with an error, not a hang; and answer each request ``latency`` seconds late, concurrent requests overlapping (a server
that batches them). It can report another ``--logprobs-mode`` in ``/server_info`` (``logprobs_mode``; None: no such
field, as an older vLLM) and answer NaN for the log-prob of every k-th token it samples (``nan_logprob_every``, counted
over the server's life, so that completions of one group differ), as vLLM does for a token it could not score.

LoRA, as vLLM serves it with ``--enable-lora`` and run-time loading: ``/v1/load_lora_adapter`` reads a peft adapter
directory (``adapter_config.json``, ``adapter_model.safetensors``), ``/v1/unload_lora_adapter`` forgets one, and a
completion request naming an adapter in ``model`` samples from the base weights plus that adapter's ``scale * B @ A``
on each target layer (peft's LoRA, merged); a name it does not hold is answered 404, as vLLM answers. ``lora=False``
answers the load as a server without ``--enable-lora`` does (500, vLLM's message); ``lora=None`` as one without
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (no such endpoint: 404 Not Found).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class JSONHandler(BaseHTTPRequestHandler):
    """A quiet request handler that answers JSON (the test servers' shared part)."""

    def log_message(self, *args):
        pass

    def answer(self, body: dict, status: int = 200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class PolicyServer:
    """Serves ``/health``, ``/v1/models``, ``/server_info``, ``/v1/completions`` (token-id prompts),
    ``/collective_rpc`` (``reload_weights`` from a safetensors directory; other methods are accepted and do nothing)
    and ``/reset_prefix_cache``. Counts requests by (method, path), and RPCs as ("RPC", method); ``versions`` lists,
    per generate request, how many reloads the server had applied when it ran."""

    def __init__(self, model_dir: str, stall_on: tuple[int, ...] = (), seed: int = 0, seconds_per_token: float = 0.0,
                 busy_resets: int = 0, latency: float = 0.0, logprobs_mode: str | None = "processed_logprobs",
                 nan_logprob_every: int = 0, lora: bool | None = True, data_parallel_size: int | None = None,
                 perturb: float = 0.0, marks: bool = True):
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()  # one request at a time touches the model (as one vLLM engine)
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: Counter = Counter()
        self.counting = threading.Lock()  # requests arrive at once (a seeded batch is one request per prompt)
        self.bodies: list[tuple] = []  # (prompts, n, seed, max_tokens) of each generate request, in arrival order
        self.reloads = 0
        self.versions: list[int] = []  # reloads applied when each generate request ran
        self.completions: list[int] = []  # completions each generate request returned
        self.stall_on = set(stall_on)
        self.busy_resets = busy_resets  # answer this many prefix-cache resets as vLLM does while blocks are held
        self.seconds_per_token = seconds_per_token  # a slower server, for requests that outlast a training step
        # each generate request answers this much later, outside the model lock: concurrent requests overlap, as a
        # server that batches them (vLLM) answers a batch in about one request's time
        self.latency = latency
        self.reset_delay = 0.0  # seconds before each prefix-cache reset is answered (a stalled server)
        self.failing: set[str] = set()  # POST paths answered with a 500
        self.in_flight = self.most_in_flight = 0  # generate requests open at once (now, and the most seen)
        # what /server_info reports (its sampled tokens' log-probs are processed ones whatever it reports)
        self.model_config = {} if logprobs_mode is None else {"logprobs_mode": logprobs_mode}
        # what /server_info reports of its engines (--data-parallel-size; None: no such field)
        self.parallel_config = {} if data_parallel_size is None else {"data_parallel_size": data_parallel_size}
        self.nan_logprob_every = nan_logprob_every  # every k-th token sampled is answered with a NaN log-prob
        # a sampler that is not the trainer's policy (vLLM's kernels, a quantised engine...): its logits shifted by
        # ``perturb`` times a fixed random direction; it samples from, and reports the log-probs of, that policy
        vocab = self.model.config.vocab_size
        self.perturbation = perturb * torch.randn(vocab, generator=torch.Generator().manual_seed(1234))
        self.tokens_sampled = 0
        self.lora = lora
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # name -> {base weight name: scale * B @ A}
        self.lora_events: list[tuple[str, str]] = []  # ("load" | "unload" | "generate" | "unknown", name), in order
        # path -> how its next POSTs are lost: "before" (the connection closes before the request runs: a keep-alive
        # connection the server closed as it was reused) or "after" (it ran, the answer never comes back)
        self.drops: dict[str, list[str]] = {}
        # the worker extension's mark of the weights loaded last (bapo_weights_mark), kept as `bapo serve` keeps it;
        # ``marks=False``: a server without the extension (the RPC is accepted and answers nothing)
        self.marks, self.mark = marks, None
        self.release = threading.Event()
        self.stalled_at: float | None = None  # time.perf_counter() when the first stalled request arrived
        server = self

        class Handler(JSONHandler):
            def answer(self, body: dict, status: int = 200):
                if getattr(self, "answer_lost", False):  # the request ran; its connection closes before the answer
                    self.close_connection = True
                    return
                super().answer(body, status)

            def do_GET(self):
                server.requests["GET", self.path.split("?")[0]] += 1
                served = [{"id": "stand-in"}] + [{"id": name} for name in list(server.adapters)]
                answers = {"/v1/models": {"data": served},
                           "/server_info": {"vllm_config": {"model_config": server.model_config,
                                                            "parallel_config": server.parallel_config}}}
                self.answer(answers.get(self.path.split("?")[0], {}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with server.counting:
                    drop = server.drops.get(self.path, [])
                    how = drop.pop(0) if drop else None
                    server.requests["POST", self.path] += 1
                if how == "before":  # the connection closes before the request runs: no answer at all
                    self.close_connection = True
                    return
                if self.path in server.failing:  # an internal error, as a server in trouble answers
                    self.answer({"error": {"message": "stand-in failure", "code": 500}}, 500)
                    return
                self.answer_lost = how == "after"
                with server.counting:
                    index = server.requests["POST", self.path]
                    if self.path == "/v1/completions":
                        server.bodies.append((tuple(map(tuple, body["prompt"])), body.get("n", 1), body.get("seed"),
                                              body.get("max_tokens")))
                if self.path == "/v1/completions":
                    if index in server.stall_on:
                        server.stalled_at = server.stalled_at or time.perf_counter()
                        server.release.wait(600)  # the stall: accepted, never answered
                        return
                    with server.counting:
                        server.in_flight += 1
                        server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    try:
                        answer = server.complete(body)
                        if answer is None:  # an adapter this server does not hold
                            self.answer({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                   "code": 404}}, 404)
                            return
                        time.sleep(server.latency)
                    finally:
                        with server.counting:
                            server.in_flight -= 1
                    self.answer(answer)
                elif "lora_adapter" in self.path and server.lora is None:
                    self.answer({"detail": "Not Found"}, 404)  # FastAPI's answer for a route it does not have
                elif self.path == "/v1/load_lora_adapter":
                    if not server.lora:
                        self.answer({"error": {"message": "Call to add_lora method failed: Worker failed with error "
                                               "'LoRA is not enabled. Use --enable-lora to enable LoRA.'",
                                               "code": 500}}, 500)
                        return
                    if body["lora_name"] in server.adapters:  # vLLM's answer to a name it holds
                        self.answer({"error": {"message": f"The lora adapter '{body['lora_name']}' has already been "
                                               "loaded.", "code": 400}}, 400)
                        return
                    server.load_adapter(body["lora_name"], body["lora_path"])
                    self.answer({})
                elif self.path == "/v1/unload_lora_adapter":
                    with server.lock:
                        if body["lora_name"] not in server.adapters:
                            self.answer({"error": {"message": f"The lora adapter '{body['lora_name']}' cannot be "
                                                   "found.", "code": 404}}, 404)
                            return
                        del server.adapters[body["lora_name"]]
                        server.lora_events.append(("unload", body["lora_name"]))
                    self.answer({})
                elif self.path == "/reset_prefix_cache":
                    time.sleep(server.reset_delay)
                    with server.counting:
                        busy, server.busy_resets = server.busy_resets > 0, max(server.busy_resets - 1, 0)
                    self.answer({"success": not busy})  # vLLM: 200 either way, success false while blocks are held
                elif self.path == "/collective_rpc":
                    server.requests["RPC", body.get("method")] += 1  # by method: a start-up probe is an RPC too
                    if body.get("method") == "reload_weights":
                        server.reload(body["kwargs"]["weights_path"])
                    elif body.get("method") == "bapo_weights_mark" and server.marks:  # the worker extension's
                        if body.get("kwargs", {}).get("name") is not None:
                            server.mark = body["kwargs"]["name"]
                        self.answer({"results": [server.mark]})  # vLLM's answer: one result per worker
                        return
                    self.answer({})
                else:
                    self.answer({})

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the listen backlog: a batch's requests arrive together (default 5)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reload(self, directory: str) -> None:
        from safetensors.torch import load_file

        state = load_file(f"{directory}/model.safetensors")
        with self.lock:
            self.model.load_state_dict(state, strict=False)
            self.reloads += 1

    def load_adapter(self, name: str, directory: str) -> None:
        """Read a peft LoRA adapter as peft merges it: a linear layer adds ``scale * B @ A``, an embedding
        ``scale * (B @ A).T`` (peft's ``lora_embedding_A/B``), under the base weight's name; ``scale`` is
        ``lora_alpha / r`` (over ``sqrt(r)`` with rsLoRA), r from the tensors' shapes (rank patterns) and alpha from
        ``alpha_pattern`` where a key names the layer, as peft matches them. Computed from the files alone: building a
        peft model here would draw its layers' initial weights from the process's global torch generator, which the
        trainer beside this in-process server draws from too (TRL's shuffle of each generation batch), so a resumed
        run would shuffle differently from the run it resumes. A real server is another process."""
        import re

        from safetensors.torch import load_file

        with open(f"{directory}/adapter_config.json") as f:
            config = json.load(f)
        tensors = load_file(f"{directory}/adapter_model.safetensors")
        deltas = {}
        for key, a in tensors.items():
            kind = "embedding" if ".lora_embedding_A" in key else "linear" if ".lora_A." in key else None
            if kind is None:
                continue
            b = tensors[key.replace("lora_embedding_A", "lora_embedding_B") if kind == "embedding"
                        else key.replace(".lora_A.", ".lora_B.")]
            layer = key.split(".lora_embedding_A" if kind == "embedding" else ".lora_A.")[0]
            layer = layer.removeprefix("base_model.model.")
            r = a.shape[0]
            alpha = config["lora_alpha"]
            for pattern, value in (config.get("alpha_pattern") or {}).items():
                if re.match(rf"(.*\.)?({pattern})$", layer):
                    alpha = value
            scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
            product = b.float() @ a.float()
            deltas[f"{layer}.weight"] = scale * (product.T if kind == "embedding" else product)
        with self.lock:
            self.adapters[name] = deltas
            self.lora_events.append(("load", name))

    @contextlib.contextmanager
    def weights_for(self, name: str | None):
        """The model with ``name``'s adapter merged while the caller holds :attr:`lock` (the base weights after)."""
        deltas = self.adapters.get(name, {})
        params = dict(self.model.named_parameters())
        saved = {k: params[k].detach().clone() for k in deltas}
        for k, delta in deltas.items():
            params[k].data += delta
        try:
            yield
        finally:
            for k, value in saved.items():
                params[k].data.copy_(value)

    @torch.no_grad()
    def complete(self, body: dict) -> dict | None:
        """``n`` samples of every prompt (token ids), up to ``max_tokens``, stopping at EOS; prompt-major choices with
        the sampled tokens' log-probs under the policy held now."""
        for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
            if body.get(name, neutral) not in (neutral, -1 if name == "top_k" else neutral):
                raise ValueError(f"the stand-in server samples with temperature only, got {name}={body[name]}")
        temperature, eos = float(body.get("temperature", 1.0)), self.model.config.eos_token_id
        seed = body.get("seed")
        choices = []
        name = body.get("model")
        with self.lock, contextlib.ExitStack() as merged:
            if name not in (None, "stand-in"):
                if name not in self.adapters:
                    self.lora_events.append(("unknown", name))
                    return None
                self.lora_events.append(("generate", name))
                merged.enter_context(self.weights_for(name))
            self.versions.append(self.reloads)
            for prompt in body["prompt"]:
                for child in range(int(body.get("n", 1))):
                    generator = self.generator if seed is None else torch.Generator().manual_seed(int(seed) + child)
                    ids, logps = list(prompt), []
                    for _ in range(int(body["max_tokens"])):
                        logits = (self.model(torch.tensor([ids])).logits[0, -1].float() + self.perturbation
                                  ) / temperature
                        log_probs = torch.log_softmax(logits, -1)
                        token = int(torch.multinomial(log_probs.exp(), 1, generator=generator))
                        ids.append(token)
                        self.tokens_sampled += 1
                        unscored = self.nan_logprob_every and self.tokens_sampled % self.nan_logprob_every == 0
                        logps.append(math.nan if unscored else float(log_probs[token]))
                        if self.seconds_per_token:
                            time.sleep(self.seconds_per_token)
                        if token == eos and not body.get("ignore_eos"):
                            break
                    tokens = ids[len(prompt):]
                    choices.append({"prompt_token_ids": list(prompt), "token_ids": tokens, "logprobs": {
                        "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logps,
                        "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(tokens, logps)]}})
        self.completions.append(len(choices))
        return {"choices": choices}

    def restart(self) -> None:
        """As a server restarted at the same address: its checkpoint's weights again, no adapter loaded."""
        from transformers import AutoModelForCausalLM

        with self.lock:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
            self.adapters.clear()
            self.mark = None
            self.lora_events.append(("restart", ""))

    def resent(self) -> list[tuple]:
        """Generate requests that arrived more than once (a seeded request is never sent twice by design)."""
        seen = Counter(self.bodies)
        return [body for body, count in seen.items() if count > 1 and body[2] is not None]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
