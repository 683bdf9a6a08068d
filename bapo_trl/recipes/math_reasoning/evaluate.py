"""avg@k / pass@k of a model or checkpoint on a math dataset, scored with the training reward.

    bapo evaluate --model outputs/run/checkpoint-200 --dataset HuggingFaceH4/aime_2024 --k 16 \\
        --max_new_tokens 8192 --temperature 0.6 --output aime24.json

(the command: :mod:`bapo_trl.cli.evaluate`.)

The paper reports AIME as avg@16: the mean correctness over 16 samples per problem. pass@j (at least one of j
samples correct) uses the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, j) / C(n, j)`` for ``n`` samples
of which ``c`` are correct, for ``j`` = 1, 2, 4, ... up to ``k``. Problems are mapped with the same math formats
and the same reward as training, so the evaluation sees what the reward saw. Sampling uses transformers
``generate`` (a checkpoint directory, a hub id, or a LoRA adapter directory).
"""

from __future__ import annotations

import json
import math
import os
import time

from .. import reward_funcs
from ..datasets_io import EVALUATE_FLAGS, load_split
from . import rewards as math_rewards

#: The names ``--reward`` accepts: those of ``bapo train --reward_funcs`` (the general registry and the recipe's).
REWARD_FUNCS = {**reward_funcs.REWARD_FUNCS, **math_rewards.REWARD_FUNCS}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of ``k`` of the ``n`` samples (``c`` correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(k: int) -> list[int]:
    """1, 2, 4, ... and ``k`` itself."""
    return sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k})


def summarize(correct_counts: list[int], k: int) -> dict:
    """``avg@k`` and ``pass@j`` over the problems, as percentages (the paper's unit)."""
    if not correct_counts:
        return {f"avg@{k}": None, **{f"pass@{j}": None for j in pass_ks(k)}}
    metrics = {f"avg@{k}": 100.0 * sum(c / k for c in correct_counts) / len(correct_counts)}
    for j in pass_ks(k):
        metrics[f"pass@{j}"] = 100.0 * sum(pass_at_k(k, c, j) for c in correct_counts) / len(correct_counts)
    return metrics


def load_problems(dataset: str, config: str | None, split: str | None, fmt: str, instruction_role: str,
                  num_problems: int | None):
    """The dataset mapped to ``prompt``/``answer``; without ``split``: ``test``, else the only split there is."""
    from .data import default_config, to_math_prompts

    config = config or default_config(dataset)
    try:
        raw = load_split(dataset, config, split or "test", flags=EVALUATE_FLAGS)
    except ValueError as err:
        if split or "split" not in str(err).lower():
            raise
        # hub sets such as AIME ship a single "train" split
        raw = load_split(dataset, config, "train", flags=EVALUATE_FLAGS)
    problems = to_math_prompts(raw, fmt, dataset_name=dataset, instruction_role=instruction_role)
    return problems.select(range(min(num_problems, len(problems)))) if num_problems else problems


def load_model(path: str, dtype: str, device: str = "auto"):
    """Model and tokenizer from a model/checkpoint directory or hub id; a LoRA adapter directory is merged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import resolve_model

    path = resolve_model(path)  # a registry name (smollm2-135m-instruct) -> its converted local checkpoint
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch_dtype).merge_and_unload()
        tokenizer_path = path if os.path.exists(os.path.join(path, "tokenizer_config.json")) else \
            model.config.name_or_path
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer_path = path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def sample(model, tokenizer, prompt, k: int, batch_size: int, max_new_tokens: int, temperature: float,
           top_p: float) -> tuple[list[str], list[list[int]]]:
    """``k`` completions of one chat prompt (texts without special tokens, and their token ids up to EOS)."""
    import torch

    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    texts, ids = [], []
    for start in range(0, k, batch_size):
        n = min(batch_size, k - start)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=n,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        for row in out[:, enc.input_ids.shape[1]:].tolist():
            if tokenizer.eos_token_id in row:  # keep the EOS, drop the padding after it (as TRL does)
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            ids.append(row)
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts, ids


def evaluate(args) -> dict:
    import torch
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    reward = reward_funcs.resolve([args.reward], REWARD_FUNCS)[0]
    problems = load_problems(args.dataset, args.dataset_config, args.split, args.math_dataset_format,
                             args.math_instruction_role, args.num_problems)
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    started = time.time()
    records, counts = [], []
    bar = tqdm(problems, desc=f"avg@{args.k}", unit="problem")
    for index, row in enumerate(bar):
        texts, ids = sample(model, tokenizer, row["prompt"], args.k, args.batch_size, args.max_new_tokens,
                            args.temperature, args.top_p)
        scores = reward(prompts=[row["prompt"]] * len(texts), completions=[[{"role": "assistant", "content": t}]
                        for t in texts], completion_ids=ids, answer=[row["answer"]] * len(texts))
        record = dict(index=index, answer=row["answer"], rewards=scores, lengths=[len(i) for i in ids],
                      completion=texts[0][: args.keep_chars])
        if any(s is None for s in scores):  # the reference does not parse: skipped, as in training
            record["skipped"] = True
        else:
            record["num_correct"] = sum(s >= args.correct_threshold for s in scores)
            counts.append(record["num_correct"])
        records.append(record)
        bar.set_postfix({f"avg@{args.k}": f"{100.0 * sum(counts) / max(len(counts) * args.k, 1):.1f}"})
    report = dict(
        model=args.model, dataset=args.dataset, split=args.split, k=args.k, reward=args.reward,
        num_problems=len(records), num_scored=len(counts), num_skipped=len(records) - len(counts),
        **summarize(counts, args.k),
        generation=dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, math_instruction_role=args.math_instruction_role),
        seconds=round(time.time() - started, 2), problems=records,
    )
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return report
