"""Where a weight push's time goes with the disk reload: the write, the server's reload, the prefix-cache reset,
against a bare RPC and a one-token request of the same server.

Why: with async generation the reload sits between two requests, on generation's critical path when generation is
the slower side (``async/load_seconds``). This splits it, so a change to it can be aimed at the part that costs.

    python benchmarks/weight_push.py [--repeats 20] [--hidden 256] [--layers 4]
    python benchmarks/weight_push.py --quick     # a smoke run: 2 repeats, a smaller model

One real vLLM CPU server pinned to core 1 (``server_bench.Server``), this process on core 0; the model is
``server_bench``'s random-init Llama. Each part is timed ``--repeats`` times, interleaved (write, reload, reset,
bare RPC, one-token request, again ...); median [min, max] in milliseconds. Last line:
``write_ms=.. reload_ms=.. reset_ms=.. rpc_ms=.. request_ms=..`` (medians).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_bench import TRAINER_CORE, Server, build_model, spread  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 repeats of a model of hidden 64, 2 layers, unless given")
    opts = parser.parse_args()
    if opts.quick:  # its own defaults; values given beside it still win
        parser.set_defaults(repeats=2, hidden=64, layers=2)
        opts = parser.parse_args()
    if opts.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {opts.repeats}")
    import requests
    import torch
    from transformers import AutoModelForCausalLM

    from bapo_trl.generation.weight_sync import PROBE_METHOD, DiskWeightSync, write_weights

    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"write": [], "reload": [], "reset": [], "rpc": [], "request": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", opts.hidden, opts.layers)
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        megabytes = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        server = Server(model_dir, tmp / "server.log")
        sync = DiskWeightSync(server.url, timeout=120, root=str(tmp))
        probe = tmp / "probe.txt"
        probe.write_text("x")
        session = requests.Session()

        def timed(name, call):
            start = time.perf_counter()
            result = call()
            times[name].append(time.perf_counter() - start)
            return result

        try:
            for _ in range(opts.repeats + 1):  # the first round warms up and is dropped
                directory = timed("write", lambda: write_weights(state, str(tmp), "push-"))
                timed("reload", lambda: sync._rpc("reload_weights", "reload", weights_path=directory))
                timed("reset", lambda: sync._post("/reset_prefix_cache", "reset"))
                timed("rpc", lambda: sync._rpc(PROBE_METHOD, "probe", path=str(probe)))
                timed("request", lambda: session.post(f"{server.url}/v1/completions", timeout=60, json={
                    "model": model_dir, "prompt": [[1, 2, 3]], "max_tokens": 1, "temperature": 1.0,
                }).raise_for_status())
                shutil.rmtree(directory, ignore_errors=True)
        finally:
            sync.close()
            server.stop()
    print(f"model: Llama hidden {opts.hidden}, {opts.layers} layers, {megabytes:.1f} MiB of float32 weights; "
          f"{opts.repeats} repeats (ms, median [min, max])")
    medians = {}
    for name, values in times.items():
        ms = [v * 1000 for v in values[1:]]
        medians[name] = statistics.median(ms)
        print(f"{name:8s} {spread(ms)}")
    print(" ".join(f"{name}_ms={value:.1f}" for name, value in medians.items()))


if __name__ == "__main__":
    main()
