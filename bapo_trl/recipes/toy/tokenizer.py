"""A character-level tokenizer built with the `tokenizers` library: one token per character, spaces kept."""

from __future__ import annotations

CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz >=+-.,:?!\n")
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """The toy tokenizer as a ``PreTrainedTokenizerFast`` (left padding, eos/pad, ChatML-style chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
