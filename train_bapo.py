"""Train a language model with BAPO (adaptive clipping) on top of TRL's GRPO.

    python train_bapo.py                                   # embedded tiny model + task, CPU, a few minutes
    bapo train                                             # the same job, through the installed `bapo` command
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml train_bapo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name my_prompts.jsonl --reward_funcs my_pkg.reward

Every BAPOConfig / GRPOConfig / ModelConfig field is a flag; ``--config recipe.yaml`` works as in TRL.
"""

from bapo_trl.cli.train import main, make_parser, parse_args, run  # noqa: F401  (main/make_parser: TRL's pattern)

if __name__ == "__main__":
    run(parser=make_parser())
