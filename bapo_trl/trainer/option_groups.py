"""The groups of the options BAPO adds to TRL's, declared once: title, one line on the group, and its fields.
``bapo train --help`` and the documentation's field tables read them from here (no other copy).

Why not in each field's metadata: TRL's argument parser (HfArgumentParser) passes every metadata key but ``help`` and
``aliases`` to argparse, so a ``"group"`` key would break ``TrlParser((BAPOConfig,))`` in a user's own script. A test
(tests/test_help.py) checks that every field BAPOConfig adds to GRPOConfig is in exactly one group. Plain data."""

from __future__ import annotations

#: ``(title, one line on the group, fields)``, in the order ``bapo train --help`` lists them
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("BAPO: the bound search",
     "The adaptive clipping window [c_low, c_high], re-chosen at every loss computation so that positive-advantage "
     "tokens hold the target share of the loss.",
     ("positive_contribution_target", "ratio_lower_start", "ratio_lower_max", "ratio_lower_step", "ratio_upper_start",
      "ratio_upper_max", "ratio_upper_step", "bapo_variant", "dual_clip", "positive_contribution_mode",
      "positive_contribution_is_weighted")),
    ("BAPO: stale data (replay, partial rollout) and where batches come from",
     "Off-policy data beyond TRL's batch reuse (steps_per_generation, num_iterations): replayed groups keep the "
     "log-probs of the policy that sampled them; partial rollout grows long completions over several rounds.",
     ("replay_buffer_size", "replay_ratio", "replay_max_staleness", "replay_sampling", "replay_fill_zero_std_groups",
      "replay_saves_generation", "partial_rollout_budget", "partial_rollout_max_resumes", "rollout_source")),
    ("BAPO: async generation",
     "The vLLM server generates the next batches while the trainer trains on the current one (use_vllm, "
     "vllm_mode=server). Not TRL's AsyncGRPOTrainer: max_staleness here counts generation batches run ahead and "
     "nothing is dropped; weight_sync_steps counts optimizer steps between weight pushes.",
     ("async_generation", "max_staleness", "weight_sync_steps", "inflight_update_tokens", "lazy_weight_loading",
      "generation_backend")),
    ("BAPO: weight pushes to the vLLM servers",
     "How a LoRA run's weights reach the vLLM servers (vllm_mode=server), with or without async generation.",
     ("vllm_lora_sync",)),
    ("BAPO: numerics",
     "How non-finite inputs and extreme ratios reach the loss.",
     ("mask_nonfinite_tokens", "max_log_ratio")),
    ("BAPO: closed-loop target (experimental)",
     "Move positive_contribution_target toward a policy entropy; off unless target_entropy is set.",
     ("target_entropy", "target_adapt_rate", "target_min", "target_max")),
)
