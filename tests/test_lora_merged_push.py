"""The merged LoRA push (``vllm_lora_sync="merged"``, TRL's way) leaves the base weights exactly as they were.

TRL's push merges the adapter into the base weights in place and unmerges it after (``merge_adapter`` /
``unmerge_adapter``): in bfloat16, ``W + BA - BA`` is not ``W``, so every push moved the frozen base a little and the
model that trained drifted away from the one loaded (reported against TRL: huggingface/trl#6688). bapo_trl restores
the saved base after the unmerge; this checks it bit for bit, over 50 pushes, a run and a resume."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from support.harness import cpu_config, tiny_trainer
from support.policy_server import PolicyServer
from support.trl_stand_ins import HoldingClient, StandInClient

pytestmark = pytest.mark.usefixtures("use_test_cache")


def bf16_peft_model(model_dir):
    """The tiny model in bfloat16 with a LoRA adapter whose B is not zero (a merge changes every targeted weight)."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def base_weights(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if "lora_" not in name}


def plain(name: str) -> str:
    """A peft parameter's name as the push names it (the base model's)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def test_fifty_merged_pushes_a_run_and_a_resume_leave_the_bf16_base_bit_exact(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir)
    try:
        model = bf16_peft_model(tiny_model_dir)
        before = base_weights(model)
        args = cpu_config(tmp_path / "out", bf16=True, use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=server.url, vllm_server_timeout=30, vllm_lora_sync="merged",
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                          steps_per_generation=2, max_steps=4, learning_rate=5e-3, logging_steps=1, seed=0,
                          save_strategy="steps", save_steps=1, disable_tqdm=True)
        trainer = tiny_trainer(tiny_model_dir, args, model=model)
        merged = 0
        for _ in range(50):
            state = trainer.vllm_generation.gather_state()  # TRL's merged walk: merge, read, unmerge
            merged += any(not torch.equal(state[plain(name)], value) for name, value in before.items()
                          if ".base_layer." in name)
        assert merged == 50  # every push carried merged weights, not the base
        after = base_weights(trainer.model)
        drifted = [name for name in before if not torch.equal(before[name], after[name])]
        assert not drifted, f"{len(drifted)} base tensors moved, e.g. {drifted[:3]}"
        trainer.train()  # pushes through the server at every generation
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
        assert server.requests["RPC", "reload_weights"] >= 2
        after = base_weights(trainer.model)
        assert all(torch.equal(before[name], after[name]) for name in before)
    finally:
        server.close()


@pytest.mark.parametrize("abort", ["closed", "raised", "push failed", "push interrupted", "gather interrupted",
                                   "reload interrupted"])
def test_a_merged_walk_cut_short_leaves_the_adapter_counted_once(tiny_model_dir, tmp_path, monkeypatch, abort):
    """Issue 75, finding 2: TRL's merged walk closed after 3 tensors (``closed``: the push's generator closed, as an
    interrupted push does; ``raised``: the consumer raises and drops it; ``push failed``: TRL's own push, the path CUDA
    takes, whose client fails with the error still held, as a notebook holds the last one; ``push interrupted``: the
    same with Ctrl-C; ``gather interrupted``, ``reload interrupted``: Ctrl-C while the disk push, or the colocated
    reload (CPU), copies the walk's third tensor, the error held) leaves the model as it was:
    the bf16 base bit exact, no layer flagged merged, the same logits; the next whole push sends the same merged
    weights as one made before the abort (the adapter merged once, not saved into the "base" and added again). ``push
    failed`` and ``reload interrupted`` were seen failing with the walk left open until the error was freed."""
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir)
    try:
        model = bf16_peft_model(tiny_model_dir)
        args = cpu_config(tmp_path / "out", bf16=True, use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=server.url, vllm_server_timeout=30, vllm_lora_sync="merged",
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=6)
        trainer = tiny_trainer(tiny_model_dir, args, model=model)
        generation, ids = trainer.vllm_generation, torch.tensor([[6, 7, 14, 43, 9]])
        before, logits = base_weights(trainer.model), trainer.model(input_ids=ids).logits.detach()
        pushed = generation.gather_state()
        walk = generation._iter_named_params()
        if abort.startswith("push"):
            del walk
            error = ConnectionError("the server is gone (stand-in)") if abort == "push failed" else KeyboardInterrupt()
            with monkeypatch.context() as patch:
                patch.setattr(type(generation), "uses_disk_sync", property(lambda self: False))
                patch.setattr(generation, "vllm_client", StandInClient(stop_after=2, error=error))
                with pytest.raises(type(error)) as held:  # the error, held
                    generation.sync_weights()
        elif abort.endswith("interrupted"):
            del walk
            walked = generation._walk_named_params

            class Interrupting:  # the third tensor's copy to the CPU is where Ctrl-C lands
                def detach(self):
                    raise KeyboardInterrupt

            def interrupted_walk():
                for index, (name, param) in enumerate(walked()):
                    yield name, Interrupting() if index == 2 else param

            with monkeypatch.context() as patch:
                patch.setattr(generation, "_walk_named_params", interrupted_walk)
                with pytest.raises(KeyboardInterrupt) as held:
                    generation.gather_state() if abort.startswith("gather") else generation._reload_colocated()
        elif abort == "closed":
            for _ in range(3):
                next(walk)
            walk.close()
        else:
            with pytest.raises(KeyboardInterrupt):
                for index, _ in enumerate(walk):
                    if index == 2:
                        raise KeyboardInterrupt
            del walk
        from peft.tuners.tuners_utils import BaseTunerLayer

        assert not any(m.merged for m in trainer.model.modules() if isinstance(m, BaseTunerLayer))
        after = base_weights(trainer.model)
        assert all(torch.equal(before[name], after[name]) for name in before)
        assert torch.equal(trainer.model(input_ids=ids).logits.detach(), logits)
        again = generation.gather_state()
        assert all(torch.equal(pushed[name], again[name]) for name in pushed)
        assert abort in ("closed", "raised") or held.value is not None
    finally:
        server.close()


@pytest.fixture
def merged_push_trainer(tiny_model_dir, tmp_path, monkeypatch):
    """A bfloat16 LoRA trainer whose pushes merge the adapter (``vllm_lora_sync="merged"``), beside a stand-in server
    (closed after the test)."""
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir)
    try:
        args = cpu_config(tmp_path / "out", bf16=True, use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=server.url, vllm_server_timeout=30, vllm_lora_sync="merged",
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=6)
        yield tiny_trainer(tiny_model_dir, args, model=bf16_peft_model(tiny_model_dir))
    finally:
        server.close()


def test_trls_push_sends_the_merged_weights_to_a_client_that_reads_them_after_the_walk(merged_push_trainer,
                                                                                        monkeypatch):
    """Review s8, F1: on CUDA, TRL's push hands the merged walk to vLLM's packed NCCL transfer, which keeps views of
    the tensors and concatenates its last chunk (the whole model under 1 GB) after the walk has ended, when TRL's walk
    has unmerged in place: the server got the base weights, the adapter was never sampled. A stand-in client that
    reads the walk's tensors only after the walk (as ``pack_tensors`` does) receives exactly the merged weights the
    disk push writes. Seen failing before the walk yielded copies inside TRL's push."""
    trainer = merged_push_trainer
    generation, before = trainer.vllm_generation, base_weights(trainer.model)
    merged = generation.gather_state()  # copied as the walk goes
    assert any(not torch.equal(merged[plain(name)], value) for name, value in before.items()
               if ".base_layer." in name)
    client = HoldingClient()
    with monkeypatch.context() as patch:
        patch.setattr(type(generation), "uses_disk_sync", property(lambda self: False))
        patch.setattr(generation, "vllm_client", client)
        generation.sync_weights()
    assert set(client.values) == set(merged)
    differ = [name for name in merged if not torch.equal(client.values[name], merged[name])]
    assert not differ, f"{len(differ)} tensors reached the server unmerged, e.g. {differ[:3]}"
    assert all(torch.equal(before[name], value) for name, value in base_weights(trainer.model).items())


class NotTheMainProcess:
    """The generation's accelerator as another process of a launch sees it (a STAND-IN: one process here)."""

    is_main_process = False

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


@pytest.mark.parametrize("main", [True, False], ids=["the main process", "another process"])
def test_trls_push_copies_the_merged_weights_only_for_the_main_process_transfer(main, merged_push_trainer,
                                                                                 monkeypatch):
    """Review s9, F7: the merged walk's copies (for vLLM's packed transfer, above) cost memory and time on the
    weights' device (on CUDA, the GPU), so they are made only where a consumer may hold what it is given: the main
    process's transfer walk in server mode. TRL's metadata walk (names, shapes, dtypes) and another
    process's walk (its gathers only) yield the model's own tensors. Seen failing when every walk of TRL's push
    copied."""
    trainer = merged_push_trainer
    generation = trainer.vllm_generation
    own = {p.data_ptr() for p in trainer.model.parameters()}
    walks, walk = [], generation._iter_named_params

    def recording():  # per walk: whether each tensor yielded is the model's own
        walks.append([])
        for name, tensor in walk():
            walks[-1].append(tensor.data_ptr() in own)
            yield name, tensor

    client = HoldingClient()
    with monkeypatch.context() as patch:
        patch.setattr(type(generation), "uses_disk_sync", property(lambda self: False))
        patch.setattr(generation, "vllm_client", client)
        patch.setattr(generation, "_iter_named_params", recording)
        if not main:
            patch.setattr(generation, "accelerator", NotTheMainProcess(generation.accelerator))
        generation._weight_metadata = None  # a first push: TRL walks for the metadata, then for the transfer
        generation.sync_weights()
    assert len(walks) == 2 and all(walks[0]) and walks[1], walks  # the metadata walk: the model's own tensors
    assert not any(walks[1]) if main else all(walks[1]), walks  # the transfer: copies on the main process only
    assert bool(getattr(client, "values", None)) == main  # only the main process sends
