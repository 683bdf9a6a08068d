"""The ``train_bapo.py`` job (also ``bapo train``), TRL's script pattern: script arguments + ``BAPOConfig`` +
``ModelConfig``.

With no ``--model_name_or_path`` it trains the embedded default: a tiny model and tokenizer built offline (and
cached), warm-started, then BAPO on the 3-digit reversal task, on CPU, with stale data
(``steps_per_generation=8``) so the bounds move. Every ``BAPOConfig``/``GRPOConfig`` field is a flag and
``--config recipe.yaml`` works as in TRL.

On a machine without CUDA every job defaults to the CPU in float32 (``use_cpu=True, bf16=False, fp16=False``; TRL's
default is bf16, which ends in "Your setup doesn't support bf16/gpu"), with a one-line note; a flag or a ``--config``
key that sets one of them wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser

from ..trainer.bapo_config import BAPOConfig
from ..trainer.checkpoints import checkpoint_folders, clear_for_rewrite
from ..trainer.option_groups import GROUPS
from .flag_hints import unknown_flags

_training_fields = {f.name for f in dataclasses.fields(BAPOConfig)}
#: Training settings of the embedded default job (applied only when no model is given; flags still override).
EMBEDDED_DEFAULTS = dict(
    output_dir="outputs/bapo-tiny-reverse",
    use_cpu=True,
    bf16=False,
    **({"activation_checkpointing": False} if "activation_checkpointing" in _training_fields else
       {"gradient_checkpointing": False}),  # transformers >= 5.2x renamed it (the old name warns)
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    per_device_train_batch_size=32,
    num_generations=8,
    steps_per_generation=8,
    max_completion_length=12,
    temperature=1.0,
    max_steps=160,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    dataloader_num_workers=0,
)

#: Fields transformers also takes under another name (the old one wins over a default set under the new).
FIELD_ALIASES = {"activation_checkpointing": ("gradient_checkpointing",)}
#: An embedded default left unset where the user sets a field that decides it otherwise (set together, TRL refuses
#: ``generation_batch_size`` beside ``steps_per_generation``; ``max_steps`` overrides ``num_train_epochs``; no
#: checkpoint is written with ``save_strategy="no"`` whatever ``save_steps``).
EMBEDDED_YIELDS_TO = {"steps_per_generation": ("generation_batch_size",), "max_steps": ("num_train_epochs",),
                      "save_strategy": ("save_steps",)}
#: The flags of a model of the user's own, which the embedded job (a tiny model built offline) cannot honour.
MODEL_FLAGS = ("dtype", "model_revision", "attn_implementation")

#: The help's width, whatever the terminal's: the text is the same everywhere (:mod:`.train_front` stores it).
HELP_WIDTH = 110
#: The flags that print the help: the defaults they show are a run of the user's own, not the embedded job's.
HELP_FLAGS = ("-h", "--help", "--help-all", "--help_all")

#: Precision and device of any job on a machine without CUDA (each one only where the user set nothing).
CPU_DEFAULTS = dict(use_cpu=True, bf16=False, fp16=False)


@dataclass
class BAPOScriptArguments(ScriptArguments):
    """Script arguments of ``train_bapo.py`` (on top of TRL's ``ScriptArguments``: ``dataset_name``, splits...).

    Args:
        reward_funcs (`list[str]`, *optional*):
            Reward functions by registry name (see :data:`bapo_trl.cli.rewards.REWARD_FUNCS`) or dotted import path
            (``my_pkg.rewards.my_reward``). Defaults to ``reverse`` with the embedded task, and to the shipped task's
            own reward with ``--dataset_name chat_arithmetic`` (``boxed_accuracy``).
        reward_model_name_or_path (`str`, *optional*):
            A reward model (sequence classifier) to add to the reward functions.
        prompt_column (`str`, defaults to `"prompt"`):
            Dataset column holding the prompts: plain strings, or chat messages (a list of
            ``{"role", "content"}`` dicts). Renamed to ``prompt`` for the trainer.
        num_train_prompts (`int`, defaults to `4096`):
            Number of prompts of the embedded task (used only without ``dataset_name``).
        torch_threads (`int`, *optional*):
            ``torch.set_num_threads`` for CPU runs; the embedded default uses 1 (measured several times faster than
            2 threads on a 2-core machine for a model this small).
        math_dataset_format (`str`, *optional*):
            Map a math dataset to ``prompt`` (chat messages asking for a ``\\boxed{}`` answer) and ``answer``
            columns (see :mod:`bapo_trl.recipes.math_reasoning.data`): ``auto`` (known dataset ids, then the
            columns present) or a format name (``gsm8k``, ``math``, ``dapo``, ``skywork``, ``problem_answer``...).
            ``prompt_column`` is then not used. Off by default.
        math_instruction_role (`str`, defaults to `"system"`):
            Where the boxed-answer instruction goes: ``system`` message, or ``user`` (after the problem; what
            DeepSeek-R1 models expect).
    """

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: registry names or dotted import paths. Default: 'reverse' (toy task); "
                  "'boxed_accuracy' with --dataset_name chat_arithmetic (the shipped chat arithmetic task)."},
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Optional reward model (sequence classification) added to the rewards."}
    )
    prompt_column: str = field(
        default="prompt", metadata={"help": "Dataset column with the prompts (text or chat messages)."}
    )
    num_train_prompts: int = field(default=4096, metadata={"help": "Prompts of the embedded task."})
    torch_threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads for CPU runs."})
    math_dataset_format: str | None = field(
        default=None,
        metadata={"help": "Math dataset -> prompt (boxed-answer instruction) + answer columns: 'auto' or a format "
                  "name (gsm8k, math, dapo, skywork, problem_answer, ...; see bapo_trl.recipes.math_reasoning.data). "
                  "Off by default."},
    )
    math_instruction_role: str = field(
        default="system",
        metadata={"help": "Boxed-answer instruction as a 'system' message or appended to the 'user' message.",
                  "choices": ["system", "user"]},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train a new run into an --output_dir that holds another run (checkpoints, or a finished "
                  "run's model and metrics): its files are removed first. Without it such a folder is refused "
                  "(--resume_from_checkpoint latest continues that run instead); the embedded default replaces its "
                  "own finished run and says so."},
    )


#: ``bapo train --help``: BAPO's own options first, in their groups ``(title, one line on the group, fields)``
#: (declared in :mod:`bapo_trl.trainer.option_groups`). A field without a group is still a flag, listed under "BAPO:
#: other options" (tests/test_help.py checks every one has a group).
BAPO_OPTION_GROUPS = GROUPS

#: The TRL / transformers options a BAPO run most often sets, shown in the short ``--help`` (all are in --help-all).
COMMON_TRL_OPTIONS = (
    "model_name_or_path", "output_dir", "learning_rate", "per_device_train_batch_size", "num_generations",
    "max_completion_length", "steps_per_generation", "loss_type", "importance_sampling_level", "use_vllm",
    "vllm_mode", "use_peft", "max_steps", "bf16",
)

SCRIPT_GROUP = "this command (data, rewards, threads)"
OTHER_BAPO_GROUP = "BAPO: other options"
#: TRL's and transformers' options in --help-all, after BAPO's: (title, the dataclass whose fields it holds)
TRL_GROUPS = ("TRL: GRPOConfig", "transformers: TrainingArguments (inherited by GRPOConfig)",
              "TRL: ModelConfig (model loading, LoRA, quantization)")
def _embedded_settings() -> str:
    """The embedded job's settings, as ``name=value`` pairs (for the help's description)."""
    return ", ".join(f"{name}={value}" for name, value in EMBEDDED_DEFAULTS.items())


DESCRIPTION = (
    "Train with BAPO (adaptive clipping) on top of TRL's GRPOTrainer. The defaults shown are those of a run of your "
    "own (--model_name_or_path or --config): TRL's GRPOConfig and BAPO's, and, on a machine without CUDA, the CPU in "
    "float32 (use_cpu=True, bf16=False). With neither --model_name_or_path nor --config it trains the embedded "
    "default instead: a tiny model built offline, on the 3-digit reversal task, with the reward 'reverse' and its "
    f"own settings ({_embedded_settings()}; a flag still overrides each). Every option is also a key of a --config "
    "recipe.yaml, as in TRL's scripts. At the start a run prints what it will do (model, data, steps, staleness, "
    "where it writes); at the end its summary and what it saved."
)


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def organize_help(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Regroup the flags HfArgumentParser put in one list: BAPO's own groups first (:data:`BAPO_OPTION_GROUPS`), then
    this command's script options, then TRL's GRPOConfig, transformers' TrainingArguments and TRL's ModelConfig. Only
    the help changes: every flag parses as before. Returns the groups by title."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    own = _field_names(BAPOConfig) - _field_names(GRPOConfig)
    grpo = _field_names(GRPOConfig) - _field_names(TrainingArguments)
    section_of = {name: title for title, _, names in BAPO_OPTION_GROUPS for name in names}
    for name in own - set(section_of):
        section_of[name] = OTHER_BAPO_GROUP
    for names, title in ((_field_names(BAPOScriptArguments), SCRIPT_GROUP), (grpo, TRL_GROUPS[0]),
                         (_field_names(TrainingArguments), TRL_GROUPS[1]), (_field_names(ModelConfig), TRL_GROUPS[2])):
        section_of.update({name: title for name in names if name not in section_of})
    descriptions = {title: text for title, text, _ in BAPO_OPTION_GROUPS}
    order = [title for title, _, _ in BAPO_OPTION_GROUPS] + [OTHER_BAPO_GROUP, SCRIPT_GROUP, *TRL_GROUPS]
    groups = {title: argparse._ArgumentGroup(parser, title, descriptions.get(title)) for title in order}
    for action in parser._optionals._group_actions:  # HfArgumentParser's --no_X repeats --X's help and a default
        if isinstance(action, argparse._StoreFalseAction):
            action.help, action.default = f"Turn --{action.dest} off ({action.dest}=False).", argparse.SUPPRESS
    kept = []
    for action in parser._optionals._group_actions:
        title = section_of.get(action.dest)
        (groups[title]._group_actions if title else kept).append(action)
    parser._optionals._group_actions[:] = kept  # -h, --help-all
    groups = {title: group for title, group in groups.items() if group._group_actions}
    parser._action_groups[:] = [g for g in parser._action_groups if g._group_actions] + list(groups.values())
    return groups


class _HelpAllAction(argparse.Action):
    """``--help-all``: every option, BAPO's first. Sets nothing (``dest`` is suppressed, as ``--help``'s)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help(full=True), sys.stdout)
        parser.exit()


class BAPOParser(TrlParser):
    """TRL's parser with a help a user can read, and one-line errors.

    ``--help`` lists BAPO's own options (grouped: the search, stale data, async generation, numerics), this command's
    options and the TRL options most set with BAPO, then says how to see the rest; ``--help-all`` lists every option,
    BAPO's first, then TRL's GRPOConfig, transformers' TrainingArguments and TRL's ModelConfig in groups of their own.
    Why not the whole list under ``--help``: TRL's parser prints its 330-odd options in one list, so BAPO's came
    after 1,300 lines. A TRL user knows those options and that they all still work here (said in the help, every one
    parsed in the tests); what they need to find is BAPO's, and the few TRL ones a first run sets.
    A bad flag gives one line (not a 200-line usage wall) pointing at ``--help``."""

    def __init__(self, dataclass_types, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--max_step` is not `--max_steps`: a typo is refused, not guessed
        kwargs.setdefault("description", DESCRIPTION)
        kwargs.setdefault("usage", "%(prog)s [--config recipe.yaml] [--OPTION VALUE ...]")
        super().__init__(dataclass_types, **kwargs)
        self.add_argument("--help-all", "--help_all", action=_HelpAllAction, dest=argparse.SUPPRESS,
                          help="show every option (TRL's and transformers' too) and exit")
        self.option_groups = organize_help(self)

    def _get_formatter(self):
        return self.formatter_class(prog=self.prog, width=HELP_WIDTH)  # the same text on every terminal

    def format_help(self, full: bool = False) -> str:
        """``--help`` (``full=False``): BAPO's groups, this command's and the common TRL options; ``--help-all``:
        every group."""
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        trl_titles = set(TRL_GROUPS)
        sections = [(g.title, g.description, g._group_actions) for g in self._action_groups
                    if full or g.title not in trl_titles]
        if not full:
            by_dest = {a.dest: a for title in TRL_GROUPS if title in self.option_groups
                       for a in self.option_groups[title]._group_actions}
            common = [by_dest[name] for name in COMMON_TRL_OPTIONS if name in by_dest]
            sections.append(("TRL and transformers: the options most set with BAPO",
                             f"{len(common)} of the {len(by_dest)} settings of TRL's "
                             "GRPOConfig, transformers' "
                             "TrainingArguments and TRL's ModelConfig (LoRA, quantization); all of them are accepted "
                             "here, as in TRL's own scripts.", common))
        for title, description, actions in sections:
            formatter.start_section(title)
            formatter.add_text(description)
            formatter.add_arguments(actions)
            formatter.end_section()
        formatter.add_text(None if full else "`%(prog)s --help-all` lists every option.")
        return formatter.format_help()

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    dataclass_types = (BAPOScriptArguments, BAPOConfig, ModelConfig)
    if subparsers is not None:
        parser = subparsers.add_parser("bapo", help="Train with BAPO", dataclass_types=dataclass_types)
        organize_help(parser)  # BAPO's options first, TRL's after them (TRL's own parser class: one help)
        return parser
    return BAPOParser(dataclass_types, prog=prog)


def explicit_fields(argv: list[str]) -> set[str]:
    """The fields the user set: flags on the command line (``--name``, ``--name=value``, ``--no_name``) and the
    keys of the ``--config`` file. Read from what was written, not from values that happen to equal a default."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")  # TRL's parser takes --model-name-or-path too
            names |= {name, name.removeprefix("no_")}
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml

        try:
            with open(argv[argv.index("--config") + 1]) as f:
                config = yaml.safe_load(f)
        except OSError:
            config = None  # TRL's parser reports the missing file
        if isinstance(config, dict):
            names |= set(config)
    return names


def apply_cpu_defaults(parser: TrlParser, argv: list[str], cuda_available: bool | None = None) -> dict:
    """Without CUDA: default ``use_cpu``/``bf16``/``fp16`` to the CPU in float32 wherever the user set nothing, and
    say so in one line (rank 0) when that changes the device or the precision of a job of the user's own. Returns
    the defaults applied."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return {}
    explicit = explicit_fields(argv)
    chosen = {k: v for k, v in CPU_DEFAULTS.items() if k not in explicit}
    if chosen:
        parser.set_defaults_with_config(**chosen)
    embedded = not ({"model_name_or_path", "config"} & explicit)  # the embedded job is set up for the CPU anyway
    if not embedded and {"use_cpu", "bf16"} & chosen.keys() and os.environ.get("RANK", "0") == "0":
        settings = ", ".join(f"{k}={v}" for k, v in chosen.items())
        # a precision the user chose (mixed, or the weights' dtype) is theirs, not ours: float32 only where it is ours
        precision = "" if {"bf16", "fp16", "dtype"} & explicit else " in float32"
        print(f"[bapo_trl] no CUDA device: training on the CPU{precision} ({settings}); pass "
              f"{' / '.join(f'--{k}' for k in chosen)} to choose otherwise.")
    return chosen


def parse_args(argv: list[str] | None = None, parser: TrlParser | None = None, cuda_available: bool | None = None):
    """Parse flags (and ``--config``); bad values exit with a one-paragraph error, not a traceback. Without CUDA the
    device and precision default to the CPU in float32 (:func:`apply_cpu_defaults`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser or make_parser()
    # The embedded defaults apply to a bare run; a recipe (--config) or a model of your own brings its own settings.
    # --help shows the defaults of such a run (the embedded job's are listed in the description).
    explicit = explicit_fields(argv)
    if not ({"model_name_or_path", "config"} & explicit or any(a in HELP_FLAGS for a in argv)):
        # a flag overrides the default of its own field, not of the field's other name: none is set under either
        defaults = {k: v for k, v in EMBEDDED_DEFAULTS.items()
                    if not {k, *FIELD_ALIASES.get(k, ()), *EMBEDDED_YIELDS_TO.get(k, ())} & explicit}
        if {"warmup_steps", "warmup_ratio"} & explicit and "lr_scheduler_type" in defaults:
            defaults["lr_scheduler_type"] = "constant_with_warmup"  # the embedded job's constant rate, after a warmup
        parser.set_defaults_with_config(**defaults)
    if not any(a in HELP_FLAGS for a in argv):  # the help shows TRL's defaults (the description says the CPU's)
        apply_cpu_defaults(parser, argv, cuda_available)  # before parsing: the config file and the flags override it
    notice = deepspeed_cpu_build_notice(argv, cuda_available=cuda_available)
    if notice:  # the build runs inside the parse (BAPOConfig's device setup initializes DeepSpeed's backend)
        print(notice, flush=True)
    try:
        return parser.parse_args_and_config(argv)
    except ValueError as err:  # no usage wall: the message names the field and the allowed range
        parser.exit(2, f"{parser.prog}: error: {unknown_flags_hint(parser, argv) or err}\n")


def unknown_flags_hint(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """``unknown option --max_stpes; did you mean --max_steps?`` for every flag of ``argv`` the parser does not
    know (:func:`~.flag_hints.unknown_flags`), or None when all are known."""
    return unknown_flags({option for action in parser._actions for option in action.option_strings}, argv)


SHM_OP = "deepspeed_shm_comm"


def deepspeed_cpu_build_notice(argv: list[str], environ=os.environ, cuda_available: bool | None = None) -> str | None:
    """The line rank 0 prints before a DeepSpeed job on the CPU JIT-compiles DeepSpeed's shared-memory collectives op
    (``deepspeed_shm_comm``, built whenever DeepSpeed's backend starts, one process or several: 2-4 minutes on 2
    cores, with no output), or None: not DeepSpeed (``accelerate launch`` with a DeepSpeed config, or
    ``--deepspeed``), not rank 0, CUDA, the op built into DeepSpeed's install, or already compiled in torch's
    extensions folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/py<ver>_<cpu|cuXY>``), from where
    a later launch loads it in under a second."""
    deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" or any(
        a.split("=")[0] == "--deepspeed" for a in argv)
    if not deepspeed or environ.get("RANK", "0") != "0":
        return None
    if sys.platform != "linux":  # DeepSpeed builds the op on Linux only; elsewhere it uses gloo's collectives
        return None
    import torch

    if torch.cuda.is_available() if cuda_available is None else cuda_available:
        return None
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:  # DeepSpeed missing or broken: the launch itself will say so
        return None
    if installed_ops.get(SHM_OP):
        return None
    root = environ.get("TORCH_EXTENSIONS_DIR")
    if not root:  # torch.utils.cpp_extension's default
        from torch.utils.cpp_extension import get_default_build_root

        build = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        build = f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else build
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{build}")
    folder = os.path.join(root, SHM_OP)
    if os.path.exists(os.path.join(folder, f"{SHM_OP}.so")):
        return None
    return (f"[bapo_trl] DeepSpeed on the CPU: compiling its shared-memory op ({SHM_OP}) into {folder} before "
            "training starts, once: a few minutes without output (2-4 on 2 cores); later launches load it from there "
            "(docs/distributed.md).")


class SetupError(SystemExit):
    """A bad flag, dataset, reward or model path: reported as one ``error:`` line, exit code 2, no traceback."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


#: What says a folder holds a run's output besides its ``checkpoint-N`` folders: any of these (``bapo train``'s
#: metrics, a saved model or adapter, the config it saved, the dynamics log, the launch record).
RUN_MARKERS = ("metrics.jsonl", "model.safetensors", "adapter_model.safetensors", "training_args.bin",
               "bapo_log_history.json", "launch_info")


def previous_run(output_dir: str) -> list[str]:
    """What an earlier run left in ``output_dir``: its ``checkpoint-N`` folders and, where a run marker is there, every
    file ``bapo train`` writes (``SAVED_FILES``); empty for a folder without a run (or none)."""
    from ..reporting.summary import SAVED_FILES

    if not os.path.isdir(output_dir):
        return []
    names = set(os.listdir(output_dir))
    left = [name for name in SAVED_FILES if name in names] if names & set(RUN_MARKERS) else []
    return checkpoint_folders(output_dir) + left


def remove_previous_run(output_dir: str) -> None:
    """Remove what :func:`previous_run` finds (main process), so nothing of the old run survives beside the new. The
    run markers go last: a removal stopped part-way (an error, Ctrl-C) leaves a folder that is still seen as holding
    that run, so the next ``bapo train`` refuses it or removes the rest, never trains beside a remnant of it. A
    checkpoint loses its completion marker first (durably), so one stopped half-removed is never resumed as
    ``latest`` (transformers would resume without the files it lacks, saying so only at INFO)."""
    import shutil

    found = previous_run(output_dir)
    checkpoints = set(checkpoint_folders(output_dir))
    for name in sorted(found, key=lambda n: n in RUN_MARKERS):
        path = os.path.join(output_dir, name)
        if name in checkpoints:
            clear_for_rewrite(path)
            os.rmdir(path)
        else:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def resumes_inside(training_args: BAPOConfig) -> bool:
    """Whether ``--resume_from_checkpoint`` names a checkpoint of ``--output_dir`` (``latest``/``true``, or a path in
    it)."""
    resume = training_args.resume_from_checkpoint
    if resume in (None, False):
        return False
    if resume is True or str(resume).lower() in ("latest", "true"):
        return True
    folder = os.path.realpath(training_args.output_dir)
    return os.path.realpath(str(resume)).startswith(folder + os.sep)


def output_dir_problem(training_args: BAPOConfig, script_args: BAPOScriptArguments, embedded: bool = False
                       ) -> str | None:
    """Why a run must not write into ``--output_dir``: it holds another run (checkpoints, or a finished run's model and
    metrics), which this run would mix with or replace without a word; ``--overwrite_output_dir`` together with a
    resume from that folder (it would delete the checkpoint it resumes from). None when it may. The embedded default
    replaces its own finished run (no checkpoints), as its plan says (:func:`replaces_previous_run`)."""
    if script_args.overwrite_output_dir and resumes_inside(training_args):
        return (f"--overwrite_output_dir removes the run in --output_dir {training_args.output_dir}, including the "
                f"checkpoint --resume_from_checkpoint {training_args.resume_from_checkpoint} continues from: pass "
                "--resume_from_checkpoint to continue that run, or --overwrite_output_dir to train a new one, not "
                "both.")
    if script_args.overwrite_output_dir or training_args.resume_from_checkpoint:
        return None
    found = checkpoint_folders(training_args.output_dir)
    if found:
        shown = ", ".join(found[-3:])
        return (f"--output_dir {training_args.output_dir} holds another run's checkpoints ({shown}"
                f"{', ...' if len(found) > 3 else ''}): pass --resume_from_checkpoint latest to continue that run, "
                "--overwrite_output_dir to train a new one there (the old run's files are removed first), or another "
                "--output_dir.")
    left = previous_run(training_args.output_dir)
    if left and not embedded:
        return (f"--output_dir {training_args.output_dir} holds a finished run ({', '.join(left[:3])}"
                f"{', ...' if len(left) > 3 else ''}): pass --overwrite_output_dir to replace it (its files are "
                "removed first), or another --output_dir.")
    return None


def replaces_previous_run(training_args: BAPOConfig, script_args: BAPOScriptArguments) -> bool:
    """Whether this run starts by removing an earlier run's files from ``--output_dir``: a new run (no resume) with
    ``--overwrite_output_dir``, or the embedded default over its own finished run."""
    return not training_args.resume_from_checkpoint and bool(previous_run(training_args.output_dir))


def prepare(script_args: BAPOScriptArguments, training_args: BAPOConfig, model_args: ModelConfig):
    """Everything that can fail cheaply, before any model is built or loaded: rewards, data, the model path."""
    from .data import load_prompts, set_flags
    from .launch_info import launch_errors
    from .rewards import resolve_reward_funcs

    embedded = model_args.model_name_or_path is None
    try:
        taken = output_dir_problem(training_args, script_args, embedded)
        if taken:
            raise ValueError(taken)
        mistakes = launch_errors(training_args)
        if mistakes:
            raise ValueError(" ".join(mistakes))
        model_flags = set_flags(model_args, MODEL_FLAGS)
        if embedded and model_flags:  # the tiny model is built offline, in float32, with the default attention
            raise ValueError(f"{', '.join(model_flags)} set{'s' if len(model_flags) == 1 else ''} how a model of your "
                             "own is loaded, and the embedded job builds its tiny model instead: pass "
                             "--model_name_or_path, or drop them.")
        from .data import shipped_task

        task = shipped_task(script_args.dataset_name)
        reward_names = script_args.reward_funcs or (
            [task[1]] if task is not None else ["reverse"] if embedded else None)
        if not reward_names and not script_args.reward_model_name_or_path:
            raise ValueError("no reward: pass --reward_funcs NAME [NAME ...] or --reward_model_name_or_path.")
        reward_funcs = resolve_reward_funcs(reward_names or [])
        if script_args.reward_model_name_or_path:
            reward_funcs.append(script_args.reward_model_name_or_path)
        if model_args.load_in_4bit or model_args.load_in_8bit:
            import torch

            flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
            if embedded or not torch.cuda.is_available():
                raise ValueError(f"`{flag}` quantizes the model with bitsandbytes, which needs a CUDA GPU and a model "
                                 "of your own (--model_name_or_path): drop the flag here.")
            if not model_args.use_peft:
                raise ValueError(f"`{flag}` needs `--use_peft`: a quantized model is trained through LoRA adapters.")
        if script_args.math_dataset_format not in (None, "auto"):  # a name checked before any dataset is loaded
            from ..recipes.math_reasoning.data import resolve_format

            resolve_format(script_args.math_dataset_format)
        train_dataset, eval_dataset = load_prompts(script_args, training_args)
        if not embedded:
            from transformers import AutoConfig

            from ..recipes.models import ModelSetupError, resolve_model

            try:  # a registry name (smollm2-135m-instruct): converted once, then its cached local directory
                model_args.model_name_or_path = resolve_model(model_args.model_name_or_path)
            except ModelSetupError as err:
                raise ValueError(f"--model_name_or_path {model_args.model_name_or_path!r}: {err}") from err

            try:
                AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                           trust_remote_code=training_args.trust_remote_code)
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"cannot load model {model_args.model_name_or_path!r} (from --model_name_or_path): not a local "
                    f"model directory, and not reachable as a hub id ({type(err).__name__}: {str(err)[:200]})."
                ) from err
    except (ValueError, FileNotFoundError) as err:
        raise SetupError(str(err)) from err
    return reward_funcs, train_dataset, eval_dataset


def staleness_plan(args: BAPOConfig) -> str:
    """What the run does with the data: on-policy (every ratio 1, so BAPO acts as GRPO) or stale, and from what."""
    upg = args.updates_per_generation
    sources = [name for name, on in (("replay", args.replay_enabled), ("async generation", args.async_generation),
                                     ("partial rollout", args.partial_rollout_enabled)) if on]
    if args.exactly_on_policy:
        return f"on-policy data ({args.on_policy_reason}"
    up_to = "" if args.batches_start_at_updates else "up to "
    return (f"stale data ({up_to}{_count(upg, 'optimizer step')} per generation batch"
            f"{''.join(f', {name}' for name in sources)}): BAPO re-chooses the clipping window at every update.")


def _cadence(args: BAPOConfig) -> str:
    """How often a generation batch comes, in optimizer steps."""
    micro, accumulation = args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps
    if micro % accumulation == 0:
        return _count(micro // accumulation, "optimizer step")
    straddle = "" if args.batches_start_at_updates else \
        f" (one can straddle {_count(args.updates_per_generation, 'update')})"
    return f"{micro}/{accumulation} optimizer steps{straddle}"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 'es' if thing.endswith('ss') else 's'}"


def _name(function) -> str:
    return function if isinstance(function, str) else getattr(function, "__name__", type(function).__name__)


def _data_plan(script_args: BAPOScriptArguments | None, train_dataset) -> str:
    if script_args is None or script_args.dataset_name is None:
        source = "the embedded 3-digit reversal task"
    else:
        config = f" ({script_args.dataset_config})" if script_args.dataset_config else ""
        source = f"{script_args.dataset_name}{config}, split {script_args.dataset_train_split!r}"
    if train_dataset is None:
        return source
    try:
        size = f"{len(train_dataset):,} prompt{'' if len(train_dataset) == 1 else 's'}"
    except TypeError:  # an IterableDataset: no length, and its first row is not read here
        return f"{source}: a stream of prompts"
    first = train_dataset[0]["prompt"] if len(train_dataset) and "prompt" in train_dataset.column_names else None
    kind = {str: ", plain text", list: ", conversational (chat messages)"}.get(type(first), "")
    return f"{source}: {size}{kind}"


def _output_plan(args: BAPOConfig, peft: bool) -> str:
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "no":
        checkpoints = "no checkpoints (save_strategy=no)"
    elif strategy == "steps":
        every = f"{args.save_steps:g} of the run" if args.save_steps < 1 else f"{int(args.save_steps)} steps"
        checkpoints = f"a checkpoint-N/ every {every}"
    else:
        checkpoints = f"a checkpoint-N/ every {strategy}"
    trackers = [name for name in (args.report_to or []) if name != "none"]
    every = "at every step" if args.logging_steps == 1 else f"every {args.logging_steps:g} steps"
    logs = f"metrics {every} to metrics.jsonl (a progress bar on the console)" + (
        f" and {', '.join(trackers)}" if trackers else "")
    hub = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    hub = f"; pushed to the Hub as {hub}" if args.push_to_hub else ""
    return (f"{os.path.abspath(args.output_dir)}: launch_info/ at the start, {checkpoints}; at the end the "
            f"{'LoRA adapter' if peft else 'model'} with its card (README.md), dynamics.png and "
            f"bapo_log_history.json{hub}; {logs}")


def run_plan(args: BAPOConfig, script_args: BAPOScriptArguments | None = None, model: str | None = None,
             train_dataset=None, reward_funcs=None, peft: bool = False, weights_dtype: str | None = None) -> str:
    """What the run will do, in one block printed once (rank 0) when the job starts: the model, the data and the
    rewards, the steps, the staleness of the data (:func:`staleness_plan`) and where it writes."""
    world = getattr(args, "world_size", 1)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    length = (_count(args.max_steps, "optimizer step") if args.max_steps > 0 else
              f"{args.num_train_epochs:g} epoch(s) of the prompts")
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else \
        f"{weights_dtype} weights" if weights_dtype not in (None, "float32", "auto") else "float32"
    device = "the CPU" if args.use_cpu else "the accelerator"
    prompts = args.generation_batch_size // args.num_generations
    steps = (f"{length} of {per_step} completions each ({_count(world, 'process')}), learning rate "
             f"{args.learning_rate:g} ({scheduler}), {precision} on {device}; a generation batch of {prompts} prompts "
             f"x {args.num_generations} completions of up to {args.max_completion_length} tokens every "
             f"{_cadence(args)}")
    rows = [("model", model or "(not loaded yet)"), ("data", _data_plan(script_args, train_dataset))]
    if reward_funcs is not None:
        rows.append(("rewards", ", ".join(_name(f) for f in reward_funcs) or "none"))
    rows += [("steps", steps), ("staleness", staleness_plan(args)),
             ("window", f"the search path is {args.search_path_origin}{_dual_clip_plan(args)}"),
             ("writes to", _output_plan(args, peft))]
    width = max(len(label) for label, _ in rows) + 1
    return "\n".join(["[bapo_trl] this run:"] + [f"  {label + ':':<{width}} {text}" for label, text in rows])


def _dual_clip_plan(args: BAPOConfig) -> str:
    """Where BAPO's dual clip sets TRL's ``delta`` the user left unset, the plan says so (it is not TRL's default)."""
    if args.delta is None and args.effective_delta is not None:
        return (f"; negative-advantage tokens' loss capped at delta={args.effective_delta:g} x |A| (the dual clip, "
                "on by default; TRL's delta is unset: --no_dual_clip for TRL's one-sided clip)")
    return ""


def main(script_args: BAPOScriptArguments, training_args: BAPOConfig, model_args: ModelConfig):
    import torch
    from trl import get_peft_config, get_quantization_config

    from ..generation.processes import broadcast_from_main
    from ..reporting.callbacks import PlotDynamicsCallback
    from ..reporting.summary import format_saved, format_summary
    from ..trainer.bapo_trainer import BAPOTrainer
    from .launch_info import LaunchInfoCallback
    from .progress import ConsoleProgress

    embedded = model_args.model_name_or_path is None
    threads = script_args.torch_threads or (1 if embedded else None)
    if threads:
        torch.set_num_threads(threads)
    reward_funcs, train_dataset, eval_dataset = prepare(script_args, training_args, model_args)

    if embedded:
        from ..recipes.toy import build_tiny_model

        model_path = build_tiny_model()
    else:
        model_path = model_args.model_name_or_path
        model_init_kwargs = dict(
            revision=model_args.model_revision,
            attn_implementation=model_args.attn_implementation,
            dtype=model_args.dtype,
        )
        model_init_kwargs.update(training_args.model_init_kwargs or {})
        training_args.model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}
    peft_config = get_peft_config(model_args)
    if os.environ.get("RANK", "0") == "0":
        trained = f"LoRA r={model_args.lora_r}, alpha={model_args.lora_alpha}" if peft_config else "every weight"
        model = (f"the embedded tiny model (~90k parameters, built offline and cached; {trained}): {model_path}"
                 if embedded else f"{model_path} ({trained})")
        print(run_plan(training_args, script_args, model, train_dataset, reward_funcs, peft=peft_config is not None,
                       weights_dtype=None if embedded else model_args.dtype),
              flush=True)

    trainer = BAPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        quantization_config=get_quantization_config(model_args),  # --load_in_4bit / --load_in_8bit, as TRL's script
    )
    # Once the trainer has accepted the settings (never removed for nothing), as the main process sees the folder
    # (another process may look after it removed the earlier run: every one must reach the barrier below, or none).
    processes = trainer.accelerator.num_processes
    if broadcast_from_main(replaces_previous_run(training_args, script_args), processes):
        if trainer.accelerator.is_main_process:
            left = previous_run(training_args.output_dir)
            remove_previous_run(training_args.output_dir)  # another run's: nothing of it survives beside this one
            print(f"[bapo_trl] replaced the earlier run in {os.path.abspath(training_args.output_dir)}: removed "
                  f"{', '.join(left)}", flush=True)
        trainer.accelerator.wait_for_everyone()
    ConsoleProgress.install(trainer)  # a progress bar; every metric in output_dir/metrics.jsonl
    trainer.add_callback(LaunchInfoCallback(trainer))
    trainer.add_callback(PlotDynamicsCallback())  # output_dir/dynamics.png + bapo_log_history.json at the end
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        print(format_summary(trainer.state.log_history, training_args))
        print(format_saved(training_args.output_dir), flush=True)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.accelerator.wait_for_everyone()
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers, destroy the process group (TRL's script)
        trainer.end()
    return trainer


def run(argv: list[str] | None = None, parser: TrlParser | None = None):
    """Parse and train; setup errors print one ``error:`` line on stderr and exit with code 2. A run in which no
    generation batch had a reward (:func:`~bapo_trl.reporting.summary.run_problems`) says why in ``error:`` lines and
    exits with code 1. A job of several processes on CPU ends through
    :func:`exit_past_gloo_teardown` (:func:`exits_past_gloo_teardown` says when)."""
    from ..reporting.summary import run_problems

    parser = parser or make_parser()
    with warnings.catch_warnings():  # main's plan line says it, once
        from ..rollout.settings import OnPolicyWarning

        warnings.filterwarnings("ignore", category=OnPolicyWarning)  # the plan's staleness line says it
        args = parse_args(argv, parser=parser)
    try:
        trainer = main(*args)
    except SetupError as err:
        parser.exit(2, f"{parser.prog}: error: {err.message}\n")
    problems = run_problems(trainer.state.log_history, trainer.args)
    if problems and trainer.accelerator.is_main_process:
        sys.stderr.write("".join(f"{parser.prog}: error: {problem}\n" for problem in problems))
    if exits_past_gloo_teardown(trainer.accelerator.num_processes, trainer.accelerator.device.type, trainer.args):
        exit_past_gloo_teardown(1 if problems else 0)
    if problems:
        sys.exit(1)
    return trainer


def command(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``bapo train``'s contract (:mod:`.main`): :func:`run` with the parser named ``prog``; a run it ends early exits
    itself (2 for a setup error, 1 for a run that trained nothing), so a return is a finished run."""
    run(argv, parser=make_parser(prog=prog))
    return 0


def exits_past_gloo_teardown(num_processes: int, device_type: str, args) -> bool:
    """Whether a finished job leaves through :func:`exit_past_gloo_teardown`: several processes on CPU (gloo), and no
    vLLM engine inside them (``vllm_mode="colocate"``): vLLM's CPU engine removes its shared-memory segments
    (``/dev/shm/*cpushm*``) only when the interpreter finalizes, and a segment left behind makes the next engine of
    the same name fail (``create shm in SHMManager failed. errno: 17``)."""
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    return num_processes > 1 and device_type == "cpu" and not colocated


def exit_past_gloo_teardown(code: int = 0) -> None:
    """End a finished job of several CPU processes (gloo) with exit code ``code``: the exit handlers run (loggers,
    trackers, the weight directories' cleanup), then the process leaves without finalizing the interpreter.

    Why: gloo's worker threads outlive ``destroy_process_group`` and free the last collective's work after it has
    completed; when that work holds tensors Python has let go of, freeing them takes the GIL, and if the main thread
    is by then finalizing the interpreter, the worker is torn down inside a destructor: ``terminate called without an
    active exception``, SIGABRT, and the launcher reports a failed job after a finished one (about 1 launch in 80 on
    these 2-core machines, 1 in 33 beside a busy core). The core dump: a gloo worker in ``~AsyncBarrierWork`` ->
    ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` while the main thread ran ``Py_FinalizeEx``.
    Skipping finalization leaves no such window. Jobs on CUDA (NCCL) exit normally: this path is not taken there."""
    import atexit

    atexit._run_exitfuncs()  # what normal exit runs first: logging.shutdown, weakref finalizers, trackers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

