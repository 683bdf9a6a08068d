"""A tiny vision-language model built offline from configs, for tests of GRPO on image prompts.

No hub download: the model is a randomly initialised ``LlavaForConditionalGeneration`` (a 1-layer CLIP vision tower
and a 1-layer Llama), the tokenizer is the toy character tokenizer plus an ``<image>`` token, and the image processor
is LLaVA's PIL one (no torchvision needed; Qwen2-VL's processor requires a torchvision video processor).
"""

from __future__ import annotations

import random

IMAGE_SIZE = 28  # two 14-pixel patches a side: four image tokens per image
PATCH_SIZE = 14
IMAGE_TOKEN = "<image>"
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
# Renders string content and typed parts (TRL turns every message into a list of parts for a VLM).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _build_tokenizer():
    """The toy character tokenizer with ``<image>`` in its vocabulary (a copy: the toy recipe's stays text-only)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bapo_trl.recipes.toy.tokenizer import CHARACTERS, SPECIAL

    vocab = {token: i for i, token in enumerate(SPECIAL + [IMAGE_TOKEN] + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", IMAGE_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )


def build_tiny_vlm(output_dir: str, seed: int = 0) -> str:
    """Save a tiny LLaVA model and its processor to ``output_dir`` (loadable with the Auto classes); return the path.

    Weights are drawn with a wide initialiser so that log-probs visibly depend on the image.
    """
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = _build_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<pad>", "<bos>", "<eos>", "<|im_end|>")}
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                       initializer_range=0.2, pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
                       eos_token_id=ids["<eos>"], tie_word_embeddings=False)
    num_image_tokens = (IMAGE_SIZE // PATCH_SIZE) ** 2
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(
        IMAGE_TOKEN), vision_feature_layer=-1, vision_feature_select_strategy="default",
        image_seq_length=num_image_tokens, initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids["<eos>"], ids["<|im_end|>"]]  # a completion ends with its turn
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.bos_token_id = ids["<bos>"]
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                             crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN)
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    return str(output_dir)


def make_image_dataset(num_prompts: int, seed: int = 0):
    """Prompts in TRL's VLM format (an image part then a text part) with an ``image`` column of noisy colour squares.

    ``colour`` names each image's base colour, for :func:`image_reward`.
    """
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = random.Random(seed)
    noise = np.random.default_rng(seed)
    names, images = [], []
    for _ in range(num_prompts):
        name = rng.choice(sorted(COLOURS))
        pixels = np.array(COLOURS[name], dtype=np.int16) + noise.integers(-30, 31, (IMAGE_SIZE, IMAGE_SIZE, 3))
        images.append(Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB"))
        names.append(name)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is this?"}]}]
    return Dataset.from_dict({"prompt": [prompt] * num_prompts, "image": images, "colour": names})


def image_reward(completions, colour, **kwargs) -> list[float]:
    """The share of a completion's characters that belong to the image's colour name (0 for an empty one)."""
    rewards = []
    for completion, name in zip(completions, colour, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        rewards.append(sum(ch in name for ch in text) / len(text) if text else 0.0)
    return rewards


def _keep_batches(trainer, compute_loss, model, inputs, *args, **kwargs):
    trainer.batches.append({k: v.detach().clone() if hasattr(v, "detach") else v for k, v in inputs.items()})
    return compute_loss(model, inputs, *args, **kwargs)


def train_with_the_policy_still(tmp_path, settings: dict, classes=None, also=()) -> tuple:
    """LLaVA on image prompts at learning rate 0 (the policy never moves), 4 steps with ``settings``; ``classes``:
    ``(config class, trainer class)`` (None: BAPOConfig, BAPOTrainer). Every micro-batch's ``old_per_token_logps``
    (and each key of ``also`` it carries) must be the policy's own WITH the batch's images: every ratio is 1 (within
    float noise). Returns the trainer and how many micro-batches had reference log-probs to check (an on-policy batch
    has none: TRL's loss uses its own log-probs)."""
    import torch
    from transformers import AutoProcessor

    from bapo_trl import BAPOConfig
    from bapo_trl.trainer.trl_port import forward_inputs
    from support.harness import Probe, cpu_config, probe_of

    config_cls, trainer_cls = classes or (BAPOConfig, None)
    model_dir = build_tiny_vlm(str(tmp_path / "vlm"))
    args = cpu_config(tmp_path / "out", per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      max_steps=4, learning_rate=0.0, logging_steps=1, save_strategy="no", disable_tqdm=True,
                      config_cls=config_cls, **settings)
    cls = Probe if trainer_cls is None else probe_of(trainer_cls)
    trainer = cls(model=model_dir, reward_funcs=image_reward, args=args, train_dataset=make_image_dataset(16),
                  processing_class=AutoProcessor.from_pretrained(model_dir), around={"compute_loss": _keep_batches},
                  record=("batches",))
    trainer.train()
    model = trainer.model.eval()  # the policy of every step (learning rate 0), with TRL's fused log-prob head
    checked = 0
    for inputs in trainer.batches:
        assert inputs["pixel_values"].size(0) == sum(inputs["num_images"]) > 0
        if inputs.get("old_per_token_logps") is None:
            continue  # on-policy: TRL's loss uses its own log-probs as the reference (ratio 1 by construction)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        mask = inputs["completion_mask"].bool()
        with torch.no_grad():
            policy, _, _ = trainer._get_per_token_logps_and_entropies(
                model, ids, attention, inputs["completion_ids"].size(1), **forward_inputs(inputs))
        for key in ("old_per_token_logps", *also):
            if key in inputs:
                torch.testing.assert_close(inputs[key][mask], policy[mask], rtol=0, atol=1e-5)
        checked += 1
    return trainer, checked
