"""LoRA adapter pushes against the real vLLM CPU server (``bapo serve MODEL --lora-rank 8``): the sampler's log-probs
equal the trainer's with the same adapter, a replaced adapter's name is refused by the server, the guarantees
matrix's LoRA row holds, and ZeRO-3 on two processes pushes the adapter alone. Runs after the other tiny-model server
tests (conftest.py orders it), so the tiny model's server is switched once."""

from __future__ import annotations

import pytest
import requests
from peft import LoraConfig

from support.guarantee_rows import FAST, adapter_that_matters, run_row
from support.harness import tiny_trainer
from support.server_training import IN_SYNC, logp_differences, reset_server_weights

pytestmark = pytest.mark.slow

RANK = 8


@pytest.fixture
def lora_server(start_server, tiny_model_dir):
    return start_server(tiny_model_dir, lora_rank=RANK)


def model_bytes(model_dir) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["embed_tokens", "q_proj"]], ids=["linear", "embed"])
def test_a_lora_run_samples_from_its_adapter_and_retires_old_names(lora_server, tiny_model_dir, tmp_path, targets):
    """TRL's synchronous generation, a stale batch every other step: the server's log-probs match the trainer's
    recomputation with the same adapter (the bound the full push meets; with an adapter on ``embed_tokens`` too, whose
    tensors peft names without a trailing part), every push after the first carries the adapter alone, and a replaced
    adapter's name is refused by the server (404), so it cannot be sampled from."""
    from support.server_training import server_config

    reset_server_weights(lora_server.url, tiny_model_dir)
    trainer = tiny_trainer(tiny_model_dir, server_config(lora_server, tmp_path, max_steps=6),
                           peft_config=LoraConfig(r=RANK, lora_alpha=16, target_modules=targets))
    adapter_that_matters(trainer.model)  # a sampler without the adapter would be far off from the first push
    trainer.train()
    diffs = logp_differences(trainer)
    assert len(diffs) == 3 and max(diffs) < IN_SYNC, diffs
    sync = trainer.vllm_generation.disk_sync
    assert len(sync.loaded_names) == 3 and trainer.vllm_generation.vllm_client.model == sync.loaded_names[-1]
    pushed = [h["weight_sync/pushed_bytes"] for h in trainer.state.log_history if "weight_sync/pushed_bytes" in h]
    adapter = sum(p.numel() * 4 for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert pushed[0] > model_bytes(tiny_model_dir) and all(adapter < b < adapter + 4096 for b in pushed[1:]), pushed
    # Every name is refused now: a replaced one since its replacement, the last one since the end of the run (which
    # unloads it); the log-prob gaps above show requests named the live adapter while it ran.
    for name in (sync.loaded_names[0], sync.loaded_names[-1]):
        answer = requests.post(f"{lora_server.url}/v1/completions", timeout=60,
                               json={"model": name, "prompt": [[2, 5, 6]], "max_tokens": 2})
        assert answer.status_code == 404, (name, answer.text[:300])


def test_the_lora_row_of_the_matrix_with_the_real_server(lora_server, tiny_model_dir, tmp_path):
    """Async K=1 with the adapter push: versions, staleness, behaviour log-probs recomputed with each token's saved
    LoRA policy, every resume and a second train(), on vLLM's own LoRA kernels."""
    reset_server_weights(lora_server.url, tiny_model_dir)
    run_row("async_k1_lora", FAST, tiny_model_dir, tmp_path, server=lora_server, atol=1e-3)


def test_zero3_two_processes_push_the_adapter_alone(lora_server, tiny_model_dir, tmp_path, use_test_cache):
    """`accelerate launch` ZeRO-3 on 2 processes with LoRA (train_bapo.py --use_peft), async K=1: every rank gathers
    only the adapter's parameters at each push (the base weights once), and rank 0 pushes the adapter."""
    from support.async_launches import zero3_async_from_train_bapo

    reset_server_weights(lora_server.url, tiny_model_dir)
    text, _ = zero3_async_from_train_bapo(
        lora_server.url, tmp_path / "run", "--max_completion_length", "8",
        "--use_peft", "--lora_r", str(RANK), "--lora_alpha", "16", "--lora_target_modules", "q_proj", "v_proj")
    from support.run_logs import values

    pushed = values(tmp_path / "run", "weight_sync/pushed_bytes")
    total = model_bytes(tiny_model_dir)
    assert pushed and pushed[0] > total and all(b < 0.1 * total for b in pushed[1:]), (pushed, total)
