"""Image batches (a vision-language model's ``pixel_values``, ``num_images``, ...) through every rollout source: each
either trains with the image inputs passed to every forward exactly as TRL's loss passes them (TRL's generation, the
default source with stale steps; a research candidate's own forward is tested in tests/experimental), or refuses an
image dataset at construction, naming itself and the column (replay, partial rollout, async generation: they keep
token batches without the images). The model is a real vision-language class, LLaVA, built from configs
(``tests/support/tiny_vlm.py``).

Not covered here: Qwen-style ``image_grid_thw`` batches (Qwen2-VL's processor needs torchvision, which the test
environment does not install); the pass-through reads its keys from TRL's own forward signature, checked against
TRL's loss below."""

from __future__ import annotations

import inspect
import re

import datasets
import pytest

from bapo_trl import BAPOTrainer
from bapo_trl.recipes.toy import reverse_reward
from bapo_trl.trainer.trl_port import forward_inputs, multimodal_keys
from support.harness import cpu_config

ASYNC = dict(async_generation=True, use_vllm=True, vllm_mode="server")


def test_trls_loss_passes_exactly_the_keys_every_recomputation_passes():
    """The one list (TRL's forward signature) against TRL's loss call: the same keys, read from the batch by name."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._compute_loss)
    forward = source[source.index("self._get_per_token_logps_and_entropies("):]
    forward = forward[: forward.index("\n        )")]  # the call's arguments
    passed = re.findall(r"(\w+)=inputs\.get\(\"(\w+)\"\)", forward)
    assert passed and all(keyword == key for keyword, key in passed)
    assert set(multimodal_keys()) == {key for _, key in passed}
    assert {"pixel_values", "image_grid_thw", "num_images"} <= set(multimodal_keys())
    assert forward_inputs(None) == {} and forward_inputs({"prompt_ids": 1, "pixel_values": None}) == {}


def image_dataset(column: str, rows: int = 8) -> datasets.Dataset:
    image = [[0.0]] if column == "image" else [[[0.0]]]
    return datasets.Dataset.from_dict({"prompt": ["12 ->"] * rows, "answer": ["21"] * rows, column: image * rows})


@pytest.mark.parametrize("column", ["image", "images"])
@pytest.mark.parametrize("settings,source", [
    (dict(replay_buffer_size=8, replay_ratio=0.5), "replay (`replay_buffer_size` > 0)"),
    (dict(partial_rollout_budget=2), "partial rollout (`partial_rollout_budget`)"),
    (dict(ASYNC), "async generation (`async_generation`)"),
], ids=["replay", "partial", "async"])
def test_a_source_that_drops_images_refuses_an_image_dataset_by_name(tiny_model_dir, tmp_path, settings, source,
                                                                      column):
    args = cpu_config(tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                      max_steps=1, **settings)
    with pytest.raises(ValueError) as error:
        BAPOTrainer(model=str(tiny_model_dir), reward_funcs=reverse_reward, args=args,
                    train_dataset=image_dataset(column))
    assert source in str(error.value) and f"`{column}` column" in str(error.value)


def test_replay_refuses_an_image_iterable_dataset_of_unknown_features_at_construction(tiny_model_dir, tmp_path):
    """Issue 75 (11): a 🤗 IterableDataset built from a generator has no known columns; replay read none, accepted it
    and stopped at its first batch. Its first row now says, and the trainer is refused before anything is loaded (a
    model path that does not exist: no model is built)."""
    def rows():
        for _ in range(8):
            yield {"prompt": "12 ->", "answer": "21", "image": [[0.0]]}

    dataset = datasets.IterableDataset.from_generator(rows)
    assert dataset.column_names is None  # unknown features: the case this covers
    args = cpu_config(tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                      max_steps=1, replay_buffer_size=8, replay_ratio=0.5)
    with pytest.raises(ValueError, match="replay .* `image` column"):
        BAPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=reverse_reward, args=args, train_dataset=dataset)


# -- a real vision-language class (tests/support/tiny_vlm.py: LLaVA built from configs) through TRL's own generation --

@pytest.mark.parametrize("settings", [
    dict(steps_per_generation=1),
    dict(steps_per_generation=2),
    dict(steps_per_generation=1, num_iterations=2),
], ids=["on_policy", "steps_per_generation_2", "num_iterations_2"])
def test_a_vision_language_model_trains_with_ratios_of_one_when_the_policy_stands_still(tmp_path, settings):
    """LLaVA on image prompts, learning rate 0 (the policy never moves): every micro-batch's reference log-probs
    (TRL's) are the policy's own WITH the batch's images, so every ratio is exactly 1 (within float noise)."""
    from support.tiny_vlm import train_with_the_policy_still

    _, checked = train_with_the_policy_still(tmp_path, settings)
    assert checked > 0 or settings == dict(steps_per_generation=1)
