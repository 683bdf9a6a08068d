"""Help a user can read: ``bapo train --help`` starts with BAPO's own options, grouped, and says how to see TRL's
(``--help-all``, every one still accepted); ``bapo evaluate --help`` shows its defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from transformers import TrainingArguments
from trl import GRPOConfig, ModelConfig, TrlParser

from bapo_trl.cli import evaluate as evaluate_cli
from bapo_trl.cli import train as train_cli
from bapo_trl.cli.main import main as bapo
from bapo_trl.trainer.bapo_config import BAPOConfig

GRPO_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}
OWN_FIELDS = [f.name for f in dataclasses.fields(BAPOConfig) if f.name not in GRPO_FIELDS]
BAPO_TITLES = [title for title, _, _ in train_cli.BAPO_OPTION_GROUPS]


def command_output(capsys, *argv: str) -> str:
    try:
        code = bapo(list(argv))  # `bapo train --help` returns (answered from the snapshot), others exit
    except SystemExit as exit_info:
        code = exit_info.code
    assert code in (0, None)
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def parser():
    return train_cli.make_parser(prog="bapo train")


def test_every_bapo_field_is_in_one_group_and_every_named_option_exists():
    grouped = [name for _, _, names in train_cli.BAPO_OPTION_GROUPS for name in names]
    assert sorted(grouped) == sorted(OWN_FIELDS), "a BAPOConfig field is missing from BAPO_OPTION_GROUPS, or twice"
    trl_fields = {f.name for cls in (GRPOConfig, TrainingArguments, ModelConfig) for f in dataclasses.fields(cls)}
    assert set(train_cli.COMMON_TRL_OPTIONS) <= trl_fields


def test_train_help_starts_with_bapos_options_in_their_groups(capsys):
    text = command_output(capsys, "train", "--help")
    lines = text.splitlines()
    first_bapo = next(i for i, line in enumerate(lines)
                      if any(line.startswith((f"  --{name} ", f"  --{name},")) for name in OWN_FIELDS))
    assert first_bapo < 60, first_bapo
    headings = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert headings[:len(BAPO_TITLES) + 1] == ["options", *BAPO_TITLES], headings  # after -h / --help-all
    assert train_cli.SCRIPT_GROUP in headings and headings[-1].startswith("TRL and transformers")
    for name in OWN_FIELDS + list(train_cli.COMMON_TRL_OPTIONS) + ["reward_funcs", "dataset_name"]:
        assert f"--{name} " in text or f"--{name}," in text, name
    assert "--lr_scheduler_type" not in text and "--lora_r" not in text  # TRL's others: behind --help-all
    assert "bapo train --help-all" in lines[-1]
    assert len(lines) < 450  # was 1,534 lines, BAPO's options from line ~1,400


def test_help_all_lists_every_option_bapos_first(capsys, parser):
    text = command_output(capsys, "train", "--help-all")
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert [h for h in headings if h.startswith("BAPO")] == BAPO_TITLES
    assert headings.index(BAPO_TITLES[-1]) < headings.index(train_cli.SCRIPT_GROUP) < headings.index(
        train_cli.TRL_GROUPS[0])
    assert [h for h in headings if h in train_cli.TRL_GROUPS] == list(train_cli.TRL_GROUPS)
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:
            assert action.option_strings[0] in text, action.option_strings


def test_the_regrouped_parser_has_every_flag_of_trls_parser(parser):
    """Only the help changed: the same flags, to the same fields, as TRL's parser of the same dataclasses."""
    plain = TrlParser((train_cli.BAPOScriptArguments, BAPOConfig, ModelConfig))

    def flags(p):
        return {(s, a.dest) for a in p._actions for s in a.option_strings} - {("--help-all", "==SUPPRESS=="),
                                                                              ("--help_all", "==SUPPRESS==")}

    assert flags(parser) == flags(plain)
    assert {a for g in parser._action_groups for a in g._group_actions} == set(parser._actions)


FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(BAPOConfig)}


def _non_default(action: argparse.Action) -> tuple[str, object]:
    """A command-line value for ``action`` other than its default, and the value it parses to."""
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    if action.nargs == "?" and action.const is True:  # a bool field: --flag [true|false]
        return ("false", False) if action.default else ("true", True)
    annotation = FIELD_TYPES[action.dest]  # `int | None` fields parse through a function that also accepts "None"
    if "int" in annotation:
        return "3", 3
    if "float" in annotation:
        return "0.55", 0.55
    return "custom", "custom"


@pytest.mark.parametrize("name", OWN_FIELDS)
def test_every_bapo_option_parses_to_its_field(name, parser):
    (action,) = [a for a in parser._actions if a.option_strings and a.option_strings[0] == f"--{name}"]
    text, value = _non_default(action)
    for flag in (f"--{name}", f"--{name.replace('_', '-')}"):
        namespace, rest = parser.parse_known_args([flag, text])
        assert getattr(namespace, name) == value and not rest


def test_a_parsed_job_still_gives_the_three_dataclasses():
    """``--help-all`` sets nothing: parsing returns the script arguments, the config and the model config only."""
    parsed = train_cli.parse_args(["--max_steps", "2", "--ratio_upper_max", "2.5"], parser=train_cli.make_parser(),
                                  cuda_available=False)
    assert len(parsed) == 3 and isinstance(parsed[1], BAPOConfig)
    assert parsed[1].ratio_upper_max == 2.5 and parsed[1].max_steps == 2


def test_evaluate_help_shows_the_defaults(capsys):
    text = " ".join(command_output(capsys, "evaluate", "--help").split())
    for action in evaluate_cli.make_parser()._actions:
        if action.option_strings[0] == "-h":
            continue
        assert action.help, action.option_strings  # every option says what it is
        if not action.required and action.default is not None:
            assert f"(default: {action.default})" in text, action.option_strings
    assert "(default: 16)" in text and "(default: 0.6)" in text and "(default: None)" not in text


def _default_shown(text: str, flag: str) -> str:
    """The ``(default: X)`` the help prints for ``flag``."""
    block = " ".join(text.split(f"\n  {flag} ", 1)[1].split("\n  --", 1)[0].split())
    return block.rsplit("(default: ", 1)[1].split(")", 1)[0]


@pytest.mark.parametrize("help_flag", ["--help", "--help-all"])
def test_the_help_shows_the_defaults_a_run_of_your_own_gets_and_names_the_embedded_jobs(capsys, help_flag):
    """The embedded job's settings (lr 1e-3, 8 steps per generation, 160 steps) stop applying once
    --model_name_or_path or --config is given: the help shows the defaults that apply then (TRL's and BAPO's, which a
    parse of a run of your own gets), and lists the embedded job's in its description."""
    text = command_output(capsys, "train", help_flag)
    _, args, _ = train_cli.parse_args(["--model_name_or_path", "some/model"], parser=train_cli.make_parser(),
                                      cuda_available=False)
    capsys.readouterr()
    for name in ("learning_rate", "max_steps", "max_completion_length", "num_generations",
                 "positive_contribution_target"):  # each in the short help too
        assert _default_shown(text, f"--{name}") == str(getattr(args, name)), name
    assert _default_shown(text, "--steps_per_generation") == "None"  # TRL: gradient_accumulation_steps
    description = " ".join(text.split("options:", 1)[0].split())
    assert "The defaults shown are those of a run of your own (--model_name_or_path or --config)" in description
    # the same text on every machine (bapo train --help answers from a snapshot, without torch): the CPU's device and
    # precision defaults are said in the description, not in the defaults shown
    assert "on a machine without CUDA, the CPU in float32 (use_cpu=True, bf16=False)" in description
    assert _default_shown(text, "--bf16") == "None"
    assert help_flag == "--help" or _default_shown(text, "--use_cpu") == "False"
    for name, value in train_cli.EMBEDDED_DEFAULTS.items():
        assert f"{name}={value}" in description, name
    assert "learning_rate=0.001" in description and "max_steps=160" in description


def _fresh_python(code: str, cache):
    import os
    import subprocess
    import sys

    env = dict(os.environ, BAPO_TRL_CACHE=str(cache), COLUMNS="60")  # a narrow terminal: the text does not change
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


BAPO = ("import sys\nfrom bapo_trl.cli.main import main\ncode = main({argv!r})\n"
        "print('exit', code, 'torch' in sys.modules, file=sys.stderr)\n")


@pytest.mark.parametrize("flag, full", [("--help", False), ("--help-all", True), ("-h", False)])
def test_bapo_train_help_imports_no_torch_and_prints_the_parsers_text(tmp_path, monkeypatch, flag, full):
    """`bapo train --help` answers from the snapshot of these versions (shipped, or cached by a first run), without
    importing torch or TRL, and prints exactly what the parser prints (whatever the terminal's width)."""
    from bapo_trl.cli import train_front

    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path))
    if json_versions_differ(train_front):  # another transformers release than the shipped snapshot's
        train_front.remember(train_cli.make_parser)  # what a first run under these versions does
    out = _fresh_python(BAPO.format(argv=["train", flag]), tmp_path)
    assert out.stderr.strip().endswith("exit 0 False"), out.stderr[-2000:]
    assert out.stdout == train_cli.make_parser(prog="bapo train").format_help(full=full)


def json_versions_differ(train_front) -> bool:
    import json

    return json.loads(train_front.SHIPPED.read_text())["versions"] != train_front.versions()


def test_a_misspelled_flag_is_refused_with_a_suggestion_before_torch_is_imported(tmp_path):
    from bapo_trl.cli import train_front

    if json_versions_differ(train_front):
        pytest.skip("the shipped snapshot is for other versions (python -m bapo_trl.cli.train_front --write)")
    for argv, says in ((["--max_stpes", "1"], "unknown option --max_stpes; did you mean --max_steps?"),
                       (["--max_step", "1"], "unknown option --max_step; did you mean --max_steps?")):
        out = _fresh_python(BAPO.format(argv=["train", *argv]), tmp_path)
        assert out.stderr.strip().endswith("exit 2 False"), out.stderr[-2000:]
        assert f"bapo train: error: {says}" in out.stderr


def test_the_shipped_snapshot_is_for_this_version_of_the_package():
    """A release bumps ``__version__``; the snapshot it ships must be taken with it, else every user of the release
    (and the two tests here, which skip on other versions) falls back to the slow path: run `python -m
    bapo_trl.cli.train_front --write` and commit train_options.json."""
    import json

    from bapo_trl import __version__
    from bapo_trl.cli import train_front

    assert json.loads(train_front.SHIPPED.read_text())["versions"]["bapo_trl"] == __version__, (
        "bapo_trl/cli/train_options.json was taken with another bapo_trl version: run `python -m "
        "bapo_trl.cli.train_front --write`")


def test_the_shipped_snapshot_is_the_parsers_for_its_versions():
    """Under the libraries it was taken with, the shipped snapshot is the parser's: a file that declares the options
    edited without `python -m bapo_trl.cli.train_front --write` fails here (another library release only skips)."""
    import json

    from bapo_trl.cli import train_front

    shipped = json.loads(train_front.SHIPPED.read_text())
    libraries = {k: v for k, v in train_front.versions().items() if k != "options_source"}
    if {k: v for k, v in shipped["versions"].items() if k != "options_source"} != libraries:
        pytest.skip("the shipped snapshot is for other library versions")
    assert shipped == train_front.snapshot(train_cli.make_parser), (
        "the options changed: run `python -m bapo_trl.cli.train_front --write` and commit train_options.json")


def test_without_a_snapshot_of_these_versions_the_command_parses_as_before_and_caches_one(tmp_path, monkeypatch):
    from pathlib import Path

    from bapo_trl.cli import train_front

    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path))
    monkeypatch.setattr(train_front, "SHIPPED", Path(tmp_path / "none.json"))
    assert train_front.answer(["--help"], "bapo train") is None  # no snapshot: TRL's parser answers
    train_front.remember(train_cli.make_parser)
    assert train_front.cached_path(train_front.versions()).exists()
    assert train_front.answer(["--max_stpes", "1"], "bapo train") == 2
    assert train_front.answer(["--max_steps", "1"], "bapo train") is None  # a known flag: the run goes on
    assert train_front.answer(["--config", "r.yaml", "--help"], "bapo train") is None  # a recipe's defaults


def test_the_help_snapshot_is_keyed_on_the_option_declarations_not_on_whole_files(tmp_path):
    """Issue 78 (4): the shipped ``bapo train --help`` snapshot stays valid through an edit of a docstring, a comment
    or a function body in the files that declare the options (it was rewritten in 8 commits in one day); a field's
    help, default or type, a group, or an ``add_argument`` call changes its key."""
    import shutil
    from pathlib import Path

    from bapo_trl.cli.train_front import OPTION_SOURCES, options_digest

    package = Path(train_cli.__file__).resolve().parents[1]
    copy = tmp_path / "bapo_trl"
    for name in OPTION_SOURCES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(package / name, copy / name)
    original = options_digest(copy)
    assert original == options_digest(package)

    def edited(name: str, old: str, new: str) -> str:
        text = (package / name).read_text()
        assert old in text, (name, old)
        (copy / name).write_text(text.replace(old, new, 1))
        try:
            return options_digest(copy)
        finally:
            shutil.copy(package / name, copy / name)

    kept = [("trainer/bapo_config.py", '"""', '"""A docstring edited. '),
            ("cli/train.py", "\ndef ", "\n# a comment\ndef "),
            ("cli/train.py", "    embedded = model_args.model_name_or_path is None",
             "    embedded = (model_args.model_name_or_path is None)  # a body edited")]
    for name, old, new in kept:
        assert edited(name, old, new) == original, (name, old)
    changed = [("rollout/settings.py", 'metadata={"help": "', 'metadata={"help": "Edited. '),
               ("trainer/bapo_config.py", "dual_clip: bool = field(\n        default=True",
                "dual_clip: bool = field(\n        default=False")]
    for name, old, new in changed:
        assert edited(name, old, new) != original, (name, old)
