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
