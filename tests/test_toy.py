"""The embedded tiny model and task."""

import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl.recipes.toy import MARKER, build_tiny_model, build_tokenizer, make_reverse_dataset, reverse_reward


def test_tokenizer_round_trip_keeps_spaces_and_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "12 3> ab c"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok(text).input_ids) == len(text)  # one token per character
    assert tok.padding_side == "left" and tok.pad_token == "<pad>" and tok.eos_token == "<eos>"
    chat = tok.apply_chat_template([{"role": "user", "content": "123>"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and "123>" in chat
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id


def test_model_reloads_and_cache_is_reused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM CPU needs head size >= 32
    assert os.path.exists(os.path.join(tiny_model_dir, MARKER))
    stamp = os.path.getmtime(os.path.join(tiny_model_dir, "model.safetensors"))
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir  # returned from the cache, not rebuilt
    assert os.path.getmtime(os.path.join(tiny_model_dir, "model.safetensors")) == stamp


def test_reward_on_hand_written_cases():
    tok = build_tokenizer()
    eos = tok.eos_token_id

    def ids(text, end=True):
        return tok(text, add_special_tokens=False).input_ids + ([eos] if end else [])

    cases = [("321", ids("321"), 1.0), ("322", ids("322"), 0.0), ("321 ab", ids("321 ab"), 0.0),
             ("321", ids("321", end=False), 0.0), ("32", ids("32"), 0.0)]
    for text, cid, expected in cases:
        assert reverse_reward([text], ["321"], completion_ids=[cid]) == [expected], text
    # without ids (e.g. called by hand) an exact string match counts; chat completions are read too
    assert reverse_reward(["321", "12"], ["321", "21"]) == [1.0, 0.0]
    assert reverse_reward([[{"role": "assistant", "content": "321"}]], ["321"]) == [1.0]


def test_dataset_splits_are_disjoint_and_chat_option():
    train = set(make_reverse_dataset(2000, seed=0)["prompt"])
    test = set(make_reverse_dataset(500, seed=0, split="test")["prompt"])
    assert not train & test and len(test) > 150
    row = make_reverse_dataset(3, chat=True)[0]
    assert row["prompt"][0]["role"] == "user" and row["answer"] == row["prompt"][0]["content"][:3][::-1]


def test_evaluate_accuracy_counts_exact_answers(tiny_model_dir):
    """The warm-started model answers a good share of held-out prompts greedily; a random-init one none."""
    from transformers import LlamaForCausalLM

    from bapo_trl.recipes.toy import evaluate_accuracy

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = make_reverse_dataset(60, split="test")
    warm = evaluate_accuracy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, data)
    random_init = LlamaForCausalLM(AutoModelForCausalLM.from_pretrained(tiny_model_dir).config)
    assert warm > 0.2
    assert evaluate_accuracy(random_init, tok, data) == 0.0


def test_score_completions_scores_each_row_in_order_greedy_or_sampled(tiny_model_dir):
    """Per-row rewards in row order (a row given a wrong answer scores 0 where its neighbours may not); greedy by
    default, its mean is evaluate_accuracy; sampling follows torch's seed and is not greedy."""
    import torch

    from bapo_trl.recipes.toy import evaluate_accuracy, score_completions

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    data = make_reverse_dataset(40, split="test")
    greedy = score_completions(model, tok, data, batch_size=16)
    wrong = data.map(lambda row, i: {"answer": row["answer"] if i % 2 else "x"}, with_indices=True)
    assert len(greedy) == 40 and sum(greedy[1::2]) > 0
    expected = [0.0 if i % 2 == 0 else score for i, score in enumerate(greedy)]
    assert score_completions(model, tok, wrong, batch_size=16) == expected
    assert evaluate_accuracy(model, tok, data, batch_size=16) == sum(greedy) / 40
    sample = dict(do_sample=True, temperature=1.0, top_k=0)
    torch.manual_seed(3)
    first = score_completions(model, tok, data, batch_size=16, **sample)
    torch.manual_seed(3)
    assert score_completions(model, tok, data, batch_size=16, **sample) == first != greedy


def test_the_published_task_draws_the_prompts_it_always_drew():
    """The default (3 digits) is the task the published runs trained on: the same prompts for the same seed (pinned
    from the code before the variable-length variant existed), and its held-out split is every fifth number."""
    from bapo_trl.recipes.toy import DIGITS, split_prompts

    assert DIGITS == (3, 3)
    assert list(make_reverse_dataset(6, seed=0)["prompt"]) == ["493>", "971>", "538>", "052>", "332>", "654>"]
    assert list(make_reverse_dataset(4, seed=1, split="test")["prompt"]) == ["170>", "725>", "975>", "080>"]
    assert make_reverse_dataset(6, seed=0, digits=(3, 3))["prompt"] == make_reverse_dataset(6, seed=0)["prompt"]
    assert split_prompts("test") == [f"{i:03d}>" for i in range(0, 1000, 5)]


def test_variable_length_variant_covers_its_range_and_keeps_the_splits_apart():
    from bapo_trl.recipes.toy import is_test_prompt, sample_prompt

    train = make_reverse_dataset(3000, seed=0, digits=(2, 8)).to_dict()
    test = make_reverse_dataset(600, seed=1, split="test", digits=(2, 8)).to_dict()
    lengths = [len(p) - 1 for p in train["prompt"]]
    assert set(lengths) == set(range(2, 9)) and min(lengths.count(n) for n in range(2, 9)) > 3000 / 7 * 0.8
    assert all(p.endswith(">") and p[:-1].isdigit() for p in train["prompt"] + test["prompt"])
    assert all(a == p[:-1][::-1] for p, a in zip(train["prompt"], train["answer"]))
    assert not any(map(is_test_prompt, train["prompt"])) and all(map(is_test_prompt, test["prompt"]))
    assert not set(train["prompt"]) & set(test["prompt"])
    # every digit starts an answer in both splits (the 3-digit split holds out the answers starting with 0 or 5)
    for data in (train, test):
        assert {a[0] for a in data["answer"]} == set("0123456789")
    again = make_reverse_dataset(3000, seed=0, digits=(2, 8)).to_dict()
    assert again["prompt"] == train["prompt"]  # a seed fixes the prompts
    import random

    for bad in ((0, 4), (5, 2)):
        with pytest.raises(ValueError, match="digits"):
            sample_prompt(random.Random(0), "train", bad)
    with pytest.raises(ValueError, match="split"):
        sample_prompt(random.Random(0), "valid", (2, 8))


def test_variable_length_answers_fit_the_tokenizer_and_the_model():
    """Every character of the variant is in the toy vocabulary (no <unk>), and the longest prompt with the
    studies' 16-token completion fits the model's 64 positions; the reward scores answers of any length."""
    tok = build_tokenizer()
    data = make_reverse_dataset(500, seed=0, digits=(2, 8))
    ids = tok(list(data["prompt"]), add_special_tokens=False).input_ids
    assert all(tok.unk_token_id not in x for x in ids)
    assert max(map(len, ids)) + 16 <= 64 and tok.model_max_length >= 9 + 16
    eos = tok.eos_token_id
    answer = "87654321"
    right = tok(answer, add_special_tokens=False).input_ids + [eos]
    assert reverse_reward([answer], [answer], completion_ids=[right]) == [1.0]
    assert reverse_reward([answer[:-1]], [answer], completion_ids=[right[:-2] + [eos]]) == [0.0]
