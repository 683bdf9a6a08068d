"""Every private TRL/transformers name ``bapo_trl`` relies on, and every TRL/transformers method a ``bapo_trl`` class
overrides, in one list, checked once when the trainer is imported.

Why: ``BAPOTrainer`` reuses ``GRPOTrainer`` through ``super()`` and a few overrides of private methods and
attributes (the window is installed through ``epsilon_low/high``, partial rollout answers TRL's old-log-prob
forward, TRL's vLLM backend class is swapped for bapo_trl's...). A TRL release that renames or re-signs one of them
would not fail loudly: an override of a method TRL no longer calls is silently dead. So each seam is listed here with
what we expect of it, and :func:`check_trl_seams` refuses to go on, naming the seam and the TRL versions this release
was tested with, instead of training with BAPO quietly switched off. Every TRL name that
:mod:`bapo_trl.generation.trl_patches` swaps is a seam too, with the TRL code that must still look it up.

The list cannot go stale: ``tests/test_trl_seams.py`` scans every module of the package with ``ast`` and fails,
naming file and line, on a private name that trl/transformers define and no seam lists, and on a trl/transformers
method (or class attribute) that a ``bapo_trl`` class or mixin overrides without being a seam's target.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

#: The TRL versions CI tests this release with (setup.cfg pins ``trl>=1.16,<1.17`` to match).
TESTED_TRL_VERSIONS = "1.16.x"


@dataclass(frozen=True)
class Seam:
    """``module:qualname`` must exist; a callable must accept ``params`` (in that order, after ``self``) and its
    source (or, for a class, its ``__init__``'s) must mention every string in ``mentions``.

    A TRL module global that bapo_trl swaps (:mod:`bapo_trl.generation.trl_patches`) names, in ``looked_up_by``, the
    TRL code whose call the swap serves (``module:qualname``): that code must still call the name bare (``Name(``),
    looked up in the module at call time, or the swap would do nothing. ``only_if`` (``module:function``) makes a seam
    apply only where that function answers True (TRL defines ``LLM`` only where vLLM is installed)."""

    target: str
    why: str
    params: tuple[str, ...] = ()
    mentions: tuple[str, ...] = ()
    looked_up_by: str = ""
    only_if: str = ""


GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
TRAINER = "transformers.trainer:Trainer"
CLIENT = "trl.generation.vllm_client:VLLMClient"
SEAMS: tuple[Seam, ...] = (
    Seam(f"{GRPO}._get_per_token_logps_and_entropies", "the policy forward that runs the search",
         params=("model", "input_ids", "attention_mask", "logits_to_keep")),
    Seam(f"{GRPO}._compute_loss", "TRL's loss clips with the window installed in epsilon_low/high; the search "
         "applies the same entropy / off-policy masks and tool_mask to its tokens; each loss type's row "
         "(loss_types.py) mirrors its ratio (GSPO's sequence mean), its cap or gate and how it aggregates tokens",
         params=("model", "inputs"), mentions=("self.epsilon_low", "self.epsilon_high",
                                                "self._get_per_token_logps_and_entropies",
                                                "self.get_high_entropy_mask(entropies, mask",
                                                "self.get_off_policy_mask(", 'completion_mask * inputs["tool_mask"]',
                                                "(log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)",
                                                "torch.clamp(coef_1, max=self.epsilon_high).detach()",
                                                "torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)",
                                                "torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures",
                                                "self.args.sapo_temperature_pos, self.args.sapo_temperature_neg",
                                                "k_pos=self.args.vespo_k_pos",
                                                "-phi_seq * advantages * per_token_logps",
                                                'self.loss_type != "vespo"',
                                                'if self.loss_type in ["grpo", "sapo"]:',
                                                "(per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)")),
    Seam(f"{GRPO}.get_gamma_weights", "VESPO's sequence weight and gamma shape, mirrored by bapo_trl.core.gates",
         params=("advantages", "log_ratio_per_token", "mask", "importance_sampling_ratio", "k_pos", "lambda_pos",
                 "k_neg", "lambda_neg"),
         mentions=("torch.clamp(log_ratio_per_token, -20.0, 20.0)",
                   "torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)",
                   "torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)",
                   "torch.clamp(seq_log_ratio, lower_clamp, 20.0)", "is_nonneg_adv = advantages >= 0",
                   ".clamp(min=1e-4)", "lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq")),
    Seam(f"{GRPO}.compute_loss", "arms the search with the micro-batch",
         params=("model", "inputs", "return_outputs", "num_items_in_batch")),
    Seam(f"{GRPO}._generate_and_score_completions", "replay and partial rollout wrap batch making",
         params=("inputs",), mentions=("self._generate(", "old_per_token_logps",
                                        "self._get_per_token_logps_and_entropies")),
    Seam(f"{GRPO}._generate", "partial rollout serves finished completions through TRL's rollout_func hook",
         params=("prompts",), mentions=("self.rollout_func(",)),
    Seam(f"{GRPO}._generate_single_turn", "partial rollout continues completions with TRL's generation",
         params=("prompt_ids", "images", "multimodal_fields", "num_generations")),
    Seam(f"{GRPO}._tokenize_prompts", "partial rollout tokenizes the prompts it pools", params=("prompts",)),
    Seam(f"{GRPO}.log", "BAPO metrics are averaged by TRL, NaN values left out", params=("logs",),
         mentions=("isnan",)),
    Seam(f"{GRPO}.create_model_card", "the model card gets a BAPO section; TRL's card reads the three below",
         params=("model_name", "dataset_name", "tags"), mentions=("self._tag_names", "self._name", "self._paper")),
    Seam(f"{GRPO}._tag_names", "BAPOTrainer's model card tags"),
    Seam(f"{GRPO}._name", "BAPOTrainer's name on the model card"),
    Seam(f"{GRPO}._paper", "the BAPO paper cited on the model card"),
    Seam(GRPO, "attributes set by GRPOTrainer.__init__ that bapo_trl reads or replaces",
         mentions=("self.epsilon_low", "self.epsilon_high", "self.rollout_func", "self.vllm_generation",
                   "self.vllm_importance_sampling_correction", "self.eos_token_ids", "self._metrics",
                   "self.reward_func_names", "self.num_generations", "self.use_vllm",
                   "self._last_loaded_step", "self.shuffle_dataset", "self._tokenizer", "self._step",
                   "self._buffered_inputs")),
    Seam(f"{GRPO}._prepare_inputs", "TRL's generation batch in progress (_buffered_inputs, indexed by _step) joins "
         "every checkpoint", params=("generation_batch",),
         mentions=("self._buffered_inputs[self._step % self.args.steps_per_generation]",
                   "self._buffered_inputs is None")),
    Seam(f"{TRAINER}.train", "resume_from_checkpoint=True resumes from the newest complete checkpoint",
         params=("resume_from_checkpoint", "trial", "ignore_keys_for_eval")),
    Seam(f"{TRAINER}.evaluate", "evaluation puts training's random state back (TRL shuffles each generation batch "
         "with the global RNG)", params=("eval_dataset", "ignore_keys", "metric_key_prefix")),
    Seam(f"{TRAINER}._save_checkpoint", "per-rank replay / partial-rollout state joins the checkpoint",
         params=("model", "trial")),
    Seam(f"{TRAINER}._get_output_dir", "the run folder that holds the checkpoint being written", params=("trial",)),
    Seam(f"{TRAINER}._load_optimizer_and_scheduler", "a resumed checkpoint restores the per-rank rollout state",
         params=("checkpoint",)),
    Seam(f"{TRAINER}.save_model", "a saved model gets the model card with the BAPO section",
         params=("output_dir", "_internal_call")),
    Seam("transformers.trainer_callback:TrainerCallback.on_train_begin", "LaunchInfoCallback writes the launch",
         params=("args", "state", "control")),
    Seam("transformers.trainer_callback:TrainerCallback.on_train_end", "PlotDynamicsCallback saves and plots the run",
         params=("args", "state", "control")),
    Seam("transformers.trainer_callback:TrainerCallback.on_step_end", "the closed-loop target moves once per "
         "optimizer step, before a checkpoint is saved", params=("args", "state", "control")),
    Seam("transformers.trainer_callback:TrainerCallback.on_log", "bapo train's progress bar and metrics.jsonl (in "
         "place of transformers' printed dicts)", params=("args", "state", "control")),
    Seam("trl.trainer.grpo_trainer:VLLMGeneration", "swapped for bapo_trl's vLLM backend (BAPOVLLMGeneration) for "
         "the one call GRPOTrainer.__init__ makes (generation/trl_patches.py: building_generation)",
         looked_up_by=f"{GRPO}.__init__"),
    Seam("trl.generation.vllm_generation:VLLMGeneration",
         "vLLM backend: max_completion_length caps a round; async generation sends TRL's sampling settings itself; "
         "the LoRA adapter push gathers the adapter through TRL's distributed backend (ZeRO-3: collective)",
         mentions=("self._dist = DistributedBackend(", "self.model = model",
                   "self.max_completion_length", "self.server_timeout", "self.mode", "self.tensor_parallel_size",
                   "self.repetition_penalty", "self.temperature", "self.top_p", "self.top_k", "self.min_p",
                   "self.structured_outputs_regex", "self.generation_kwargs")),
    Seam("trl.generation.vllm_generation:VLLMGeneration._init_vllm", "CPU server: HTTP client instead of NCCL; "
         "on CUDA the client TRL builds from server_base_url (a fleet for several); colocate: the engine it sets "
         "(self.llm) is wrapped for per-prompt seeds (generation/trl_patches.py: seeded_engine)",
         mentions=("VLLMClient(", "base_url=base_url", "group_port=self.group_port", "connection_timeout=",
                   "self.llm = LLM(")),
    Seam("trl.generation.vllm_generation:VLLMClient", "on CUDA the server client is swapped for one that sends "
         "$VLLM_API_KEY, for the one call _init_vllm makes (generation/trl_patches.py: building_server_client)",
         mentions=("self.session", "self.check_server("),
         looked_up_by="trl.generation.vllm_generation:VLLMGeneration._init_vllm"),
    Seam("trl.generation.vllm_generation:LLM", "colocate with the LoRA adapter push: the engine is built with LoRA "
         "enabled, for the one call _init_vllm makes (generation/trl_patches.py: building_engine)",
         looked_up_by="trl.generation.vllm_generation:VLLMGeneration._init_vllm",
         only_if="trl.import_utils:is_vllm_available"),
    Seam("trl.generation.vllm_generation:VLLMGeneration.sync_weights", "CPU server: weights through disk; TRL's own "
         "push (generation/trl_push.py) counts its walks over the weights: a metadata walk while _weight_metadata is "
         "None, then one", mentions=("if self._weight_metadata is None:", "self._iter_named_params()")),
    Seam("trl.generation.vllm_generation:VLLMGeneration.generate", "colocate: the engine (self.llm, wrapped in "
         "generation/seeding.py's SeededEngine by generation/trl_patches.py) gives each prompt of a seeded call a "
         "seed of its own",
         mentions=("self.llm.generate(vllm_prompts, sampling_params=sampling_params",)),
    Seam("trl.generation.vllm_generation:VLLMGeneration._iter_named_params", "CPU server gathers weights"),
    Seam("trl.generation.vllm_generation:VLLMGeneration._place_features", "server mode, several processes: a prompt "
         "whose image tokens do not match its images fails on the main process, between the image-feature request "
         "and the generation request; shared with every process as a failed request is (FailureSharingClient)",
         params=("features", "prompt_ids")),
    Seam("trl.generation.vllm_generation:VLLMGeneration._fix_param_name_to_vllm", "the LoRA adapter push's one base "
         "push names the base weights as TRL's merged push does", params=("name", "extra_prefixes")),

    Seam(CLIENT, "HTTP client: vLLM is only checked for, and the session exists when __init__ calls check_server",
         mentions=("is_vllm_available()", "self.session", "self.check_server(")),
    Seam(f"{CLIENT}.generate", "async generation's one request per batch; a seeded call with several prompts is sent "
         "one request per prompt, each with a seed of its own (generation/seeding.py); a request names the client's "
         "model, which the LoRA adapter push sets to the adapter loaded last", mentions=('"model": self.model',),
         params=("prompts", "features", "n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
                 "max_tokens", "logprobs", "structured_outputs_regex", "generation_kwargs")),
    Seam(f"{CLIENT}.weight_update", "several servers on CUDA: one weight update per server around the stream"),
    Seam(f"{CLIENT}.update_named_params", "several servers on CUDA: each tensor streamed to every server",
         params=("metadata", "named_params")),
    Seam(f"{CLIENT}.init_communicator", "several servers on CUDA: one weight-transfer group per server",
         params=("device",)),
    Seam(f"{CLIENT}.__init__", "several servers on CUDA: a client per server, each on a group port of its own",
         params=("base_url", "host", "server_port", "group_port", "connection_timeout")),
    Seam(f"{CLIENT}.check_server", "HTTP client: bounded health probes, then requests that are never retried",
         params=("total_timeout", "retry_interval")),
    Seam(f"{CLIENT}.get_server_info", "HTTP client: a stalled server is an error naming the endpoint"),
    Seam(f"{CLIENT}.reset_prefix_cache", "both clients: retried until vLLM says it took (TRL ignores success)"),
    Seam(f"{CLIENT}._get", "request timeouts", params=("url",)),
    Seam(f"{CLIENT}._post", "request timeouts", params=("url",)),
    Seam("trl.generation.vllm_client:is_vllm_available", "HTTP client without vllm installed: answers True for the "
         "one call VLLMClient.__init__ makes (generation/trl_patches.py: client_without_vllm)",
         looked_up_by=f"{CLIENT}.__init__"),
    Seam("trl.trainer.utils:RepeatSampler", "async generation draws its prompts as TRL's sampler does"),
    Seam("trl.trainer.utils:is_async_callable", "async reward functions keep their errors named"),
)

#: TRL's experimental GMPO, which ``BAPOGMPOTrainer`` (bapo_trl/experimental/gmpo/trainer.py) puts BAPO in front
#: of: checked when that module is imported (experimental in TRL, so a user of BAPOTrainer alone never depends on it).
GMPO = "trl.experimental.gmpo.gmpo_trainer:GMPOTrainer"
GMPO_SEAMS: tuple[Seam, ...] = (
    Seam(f"{GMPO}._compute_loss", "GMPO's loss reads the window BAPO installs in epsilon_low/high as log-space "
         "bounds, runs the policy forward BAPO's search hooks, and weights a sequence by the geometric mean of its "
         "sign-clipped token ratios over the loss mask (mirrored by bapo_trl.experimental.gmpo.geometric_mean)",
         params=("model", "inputs"),
         mentions=("self._get_per_token_logps_and_entropies", "self.get_high_entropy_mask(entropies, mask",
                   'completion_mask * inputs["tool_mask"]',
                   "torch.clamp(log_ratio, min=-self.epsilon_low, max=self.epsilon_high)",
                   "torch.minimum(log_ratio, clamped_log_ratio)", "torch.maximum(log_ratio, clamped_log_ratio)",
                   "(clipped_log_ratio * seq_mask).sum(-1) / seq_mask.sum(-1).clamp(min=1.0)",
                   "per_sequence_loss = -coef * advantages", "loss = per_sequence_loss.mean()")),
)


def _resolve(target: str):
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def seam_problems(seams: tuple[Seam, ...] = SEAMS) -> list[str]:
    """One line per seam that is missing or not what bapo_trl expects (empty: all present)."""
    problems = []
    for seam in seams:
        if seam.only_if and not _resolve(seam.only_if)():
            continue
        if seam.looked_up_by:
            problems += _lookup_problems(seam)
        try:
            obj = _resolve(seam.target)
        except (ImportError, AttributeError) as err:
            problems.append(f"{seam.target} is missing ({type(err).__name__}: {err}); used for: {seam.why}")
            continue
        if seam.params:
            names = [p for p in inspect.signature(obj).parameters if p != "self"]
            if names[: len(seam.params)] != list(seam.params):
                problems.append(f"{seam.target} takes {names}, expected it to start with {list(seam.params)}; "
                                f"used for: {seam.why}")
        if seam.mentions:
            try:
                source = inspect.getsource(obj.__init__ if inspect.isclass(obj) else obj)
            except (OSError, TypeError):
                source = ""
            absent = [m for m in seam.mentions if m not in source]
            if absent:
                problems.append(f"{seam.target} no longer uses {absent}; used for: {seam.why}")
    return problems


def _lookup_problems(seam: Seam) -> list[str]:
    """The TRL code a swapped module global serves must still call it by its bare name (see :class:`Seam`)."""
    name = seam.target.rpartition(":")[2]
    try:
        source = inspect.getsource(_resolve(seam.looked_up_by))
    except (ImportError, AttributeError) as err:
        return [f"{seam.looked_up_by} is missing ({type(err).__name__}: {err}); {seam.target} is swapped for its "
                f"call; used for: {seam.why}"]
    except (OSError, TypeError):
        source = ""
    if re.search(rf"(?<![\w.]){re.escape(name)}\(", source):
        return []
    return [f"{seam.looked_up_by} no longer calls {name}(...), the name bapo_trl swaps for that call; used for: "
            f"{seam.why}"]


def check_trl_seams(seams: tuple[Seam, ...] = SEAMS) -> None:
    """Raise ``ImportError`` naming every broken seam and the TRL versions this release was tested with."""
    problems = seam_problems(seams)
    if problems:
        import trl

        raise ImportError(
            f"bapo_trl was tested with TRL {TESTED_TRL_VERSIONS}, but the installed TRL {trl.__version__} changed "
            "what BAPOTrainer builds on:\n  - " + "\n  - ".join(problems)
            + "\nInstall a tested TRL: pip install 'trl>=1.16,<1.17'."
        )
