"""Training against a vLLM server (the real one or the stand-in of policy_server.py), shared by the server tests:
the trainer's run through a server and its config, the server's weights put back between tests, and the sampler /
trainer log-prob difference TRL logs."""

from __future__ import annotations

from pathlib import Path

import torch

from bapo_trl import BAPOConfig
from support.harness import cpu_config

LOGP_DIFF = "sampling/sampling_logp_difference/mean"
IN_SYNC = 0.01  # measured ~2e-7 in float32 (the brief's bound was 0.05)


def load_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}


def reset_server_weights(url: str, model_dir: str, tied: bool = False) -> None:
    """Tests share one server: put the model's own weights back before each."""
    from bapo_trl.generation.weight_sync import DiskWeightSync

    sync = DiskWeightSync(url, timeout=60, refresh_output_layers=tied)
    try:
        sync.push(load_weights(model_dir))
    finally:
        sync.close()


def completion_length(completions, **kwargs) -> list[float]:
    """A reward that always varies within a group, so every step has a gradient (even for an untrained head)."""
    return [float(len(c)) for c in completions]


def train_with_server(model_dir: str, output_dir: Path, server_url: str, max_steps: int = 6, reward=None,
                      trainer_cls=None, callbacks=(), **overrides):
    from bapo_trl import BAPOTrainer
    from bapo_trl.recipes.toy import reverse_reward
    from support.harness import cpu_config, tiny_trainer

    host, port = server_url.removeprefix("http://").split(":")
    overrides = {"vllm_server_timeout": 30, **overrides}
    settings = dict(
        save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        logging_steps=1, seed=0, max_steps=max_steps, learning_rate=3e-3,
        steps_per_generation=2,  # every batch is trained on twice: the second time stale, so BAPO's bounds act
        use_vllm=True, vllm_mode="server", vllm_server_host=host, vllm_server_port=int(port),
    )
    args = cpu_config(output_dir, **{**settings, **overrides})
    trainer = tiny_trainer(model_dir, args, cls=trainer_cls or BAPOTrainer, reward=reward or reverse_reward,
                           prompts=64, prompt_seed=0, callbacks=callbacks)
    trainer.train()
    return trainer


def logp_differences(trainer) -> list[float]:
    return [h[LOGP_DIFF] for h in trainer.state.log_history if LOGP_DIFF in h]


def server_config(server, tmp_path, **overrides) -> BAPOConfig:
    host, port = server.url.removeprefix("http://").split(":")
    return cpu_config(tmp_path / "out", **{**dict(
        gradient_checkpointing=True,  # TRL's default, as these runs have always trained
        save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        logging_steps=1, seed=0, learning_rate=5e-3, steps_per_generation=2, max_steps=4, use_vllm=True,
        vllm_mode="server", vllm_server_host=host, vllm_server_port=int(port), vllm_server_timeout=30,
        disable_tqdm=True), **overrides})
