"""The documentation's examples are tested: README's python blocks are executed (the first one's printed output
compared with the output shown under it), and every command of a bash block in README.md, CONTRIBUTING.md and the
documentation pages (docs/*.md) is parsed by the parser that would run it; so are the benchmark commands written
inline. The site itself: every page is reachable from mkdocs.yml, and `mkdocs build --strict` passes (slow tier)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from support.launching import REPO, script_module
from support.readme_blocks import PYTHON_BLOCKS, README, REAL_MODEL_BLOCK, shown_output

SEARCH_BLOCK = next(i for i, block in enumerate(PYTHON_BLOCKS) if "search_clip_bounds(" in block)
#: The documents whose commands are checked: README, the contributor guide and every page of the site.
DOCUMENTS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "docs" / "reference").glob("*.md"))]
#: Commands shown but not parsed here, each for a reason: installers, wheel builds and make targets (run by CI itself,
#: tests/test_release.py), shell set-up (virtualenv, clone), TRL's server (tests/test_server_commands.py parses every
#: server command).
NOT_PARSED = ("make ", "pip install ", "python3 -m pip install ", "python -m pip install ", "bash scripts/", "export ",
              "trl vllm-serve ", "python -m pytest ", "python -m build", "python3 -m venv ", "python -m venv ",
              "source ", "git clone ", "cd ")
BAPO_SUBCOMMANDS = {"evaluate": "bapo_trl.cli.evaluate", "serve": "bapo_trl.cli.serve", "plot": "bapo_trl.cli.plot",
                    "models": "bapo_trl.cli.models", "env": "bapo_trl.cli.env"}


def bash_lines(path):
    """``(document, command)`` for every command line of the bash blocks of ``path``: continuation lines joined,
    comments and ``&`` dropped, environment assignments before the command removed."""
    text = path.read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().rstrip("&").strip()
            if not line or line.startswith("#"):
                continue
            while re.match(r"^\w+=\S*\s", line):
                line = line.split(None, 1)[1]
            yield path.name, line


def inline_benchmark_commands(path):
    """``(document, command)`` for each ``python benchmarks/...`` command written inline (in backticks)."""
    for span in re.findall(r"`(python3? benchmarks/[^`]+)`", path.read_text()):
        yield path.name, " ".join(span.split())


ALL_LINES = [item for path in DOCUMENTS for item in bash_lines(path)]


def kind(line: str) -> str:
    argv = shlex.split(line)
    if "train_bapo.py" in argv or argv[:2] == ["bapo", "train"]:
        return "train"
    if argv[0] == "bapo":
        return "bapo"
    if argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        return "benchmark"
    if line.startswith("mkdocs "):
        return "mkdocs"
    if line.startswith(NOT_PARSED):
        return "not parsed"
    return "unknown"


def test_every_command_shown_is_of_a_kind_the_tests_check():
    """A new kind of command in the docs needs a check here (or a reason in NOT_PARSED)."""
    unknown = [f"{where}: {line}" for where, line in ALL_LINES if kind(line) == "unknown"]
    assert unknown == [], "\n".join(unknown)
    kinds = {kind(line) for _, line in ALL_LINES}
    assert {"train", "bapo", "benchmark"} <= kinds


@pytest.mark.parametrize("index", [i for i in range(len(PYTHON_BLOCKS)) if i != REAL_MODEL_BLOCK])
def test_python_examples_run(index, tmp_path):
    env = {**os.environ, "BAPO_TRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[index]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if index == 0:  # the first example: its printed bounds are the ones shown under it, and they move
        shown = shown_output(0)
        printed = proc.stdout.strip().splitlines()[-1]
        assert printed == shown, (printed, shown)
        assert len(set(json.loads(printed))) > 1, "the first example's bounds do not move"


def test_search_example_prints_the_documented_window():
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[SEARCH_BLOCK]], capture_output=True, text=True,
                          timeout=120)
    assert "'clip_low': 0.6" in proc.stdout and "'clip_high': 1.5" in proc.stdout


def test_the_real_model_example_follows_the_toy_one_and_shows_a_reward_per_generation_batch():
    """Right after the toy example: SmolLM2 by its registry name (a Hub id on a GPU), the shipped chat task, a reward
    of the package, at least three generation batches (max_steps / steps_per_generation), and under it one reward
    line per batch and where the files went (tests/test_smollm2.py runs it)."""
    block = PYTHON_BLOCKS[REAL_MODEL_BLOCK]
    assert REAL_MODEL_BLOCK == 1 and SEARCH_BLOCK == 2
    assert "chat_arithmetic_splits()" in block and "reward_funcs=boxed_accuracy" in block
    steps = int(re.search(r"max_steps=(\d+)", block).group(1))
    per_batch = int(re.search(r"steps_per_generation=(\d+)", block).group(1))
    batches = steps // per_batch
    shown = shown_output(REAL_MODEL_BLOCK).splitlines()
    assert batches >= 3 and len(shown) == batches + 1, shown
    for line, first in zip(shown, range(1, steps, per_batch)):
        assert re.fullmatch(rf"steps {first}-{first + per_batch - 1}: reward [01]\.\d{{3}}", line), line
    assert shown[-1] == "dynamics.png and bapo_log_history.json are in outputs/smollm2-bapo"
    section = README.split("## A real model", 1)[1].split("\n## ", 1)[0]
    assert "a `prompt` column, plain text or conversational" in section and "peak RSS" in section
    assert "notebooks/bapo_quickstart.ipynb" in section and "notebooks/bapo_vs_grpo.ipynb" in section


TRAIN_COMMANDS = [(where, line) for where, line in ALL_LINES if kind(line) == "train"]


@pytest.mark.parametrize("where,command", TRAIN_COMMANDS)
def test_training_commands_parse(where, command):
    from bapo_trl.cli.train import make_parser, parse_args

    argv = shlex.split(command)
    argv = argv[argv.index("train_bapo.py") + 1 :] if "train_bapo.py" in argv else argv[argv.index("train") + 1 :]
    if "--bf16" in argv:  # a GPU command: on this CPU machine check everything but the precision flags
        argv += ["--bf16", "false", "--use_cpu", "true"]
    script_args, training_args, model_args = parse_args(argv, parser=make_parser())
    assert training_args.output_dir


#: Run in a fresh interpreter: each command's own parser parses its arguments, then stops it (argparse's
#: ``parse_args`` raises once it has parsed), so nothing is trained, served or benchmarked.
_PARSE_ONLY = r"""
import argparse, importlib, json, runpy, sys
sys.path.insert(0, "benchmarks")
class Parsed(Exception):
    pass
_parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)
    raise Parsed()
argparse.ArgumentParser.parse_args = parse_args
failures = []
for where, kind, target, argv in json.loads(sys.stdin.read()):
    try:
        if kind == "benchmark":
            sys.argv = [target, *argv]
            runpy.run_path(target, run_name="__main__")
        else:
            importlib.import_module(target).main(argv, prog="bapo")
        failures.append(f"{where}: {target} {argv}: ran without parsing its arguments")
    except Parsed:
        pass
    except SystemExit as exit:
        failures.append(f"{where}: {target} {' '.join(argv)}: refused (exit {exit.code})")
print(json.dumps(failures))
"""


def parse_only(commands: list[tuple[str, str, str, list[str]]]) -> list[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY], input=json.dumps(commands), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bapo_and_benchmark_commands_parse():
    """Every `bapo SUBCOMMAND ...` (but train, above) and `python benchmarks/... ` command shown, in a bash block or
    (benchmarks) inline, is accepted by the parser of the command it names; `bapo --version` exits 0."""
    from bapo_trl.cli.main import main as bapo_main

    commands, options = [], []
    inline = [item for path in DOCUMENTS for item in inline_benchmark_commands(path)]
    for where, line in ALL_LINES + inline:
        argv = shlex.split(line)
        if kind(line) == "bapo" and argv[1].startswith("-"):  # `bapo --version`, `bapo --help`: the command's own
            options.append((where, argv[1:]))
        elif kind(line) == "bapo" and argv[1] != "train":
            rest = argv[2:]
            if argv[1] == "serve" and "--" in rest:  # flags after `--` go to vLLM
                rest = rest[: rest.index("--")]
            commands.append((where, "bapo", BAPO_SUBCOMMANDS[argv[1]], rest))
        elif kind(line) == "benchmark":
            commands.append((where, "benchmark", argv[1], argv[2:]))
    assert len(commands) >= 20 and {c[1] for c in commands} == {"bapo", "benchmark"}
    failures = parse_only(commands)
    assert failures == [], "\n".join(failures)
    assert options, "the docs show `bapo --version`"
    for where, argv in options:
        assert bapo_main(argv) == 0, f"{where}: bapo {' '.join(argv)}"


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav_or_linked_from_a_page_that_is():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = REPO / "docs"
    in_nav = set(_nav_pages(config["nav"]))
    assert all((docs / page).is_file() for page in in_nav), in_nav
    linked = set()
    for page in in_nav:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", (docs / page).read_text()):
            linked.add(os.path.normpath(os.path.join(os.path.dirname(page), target)))
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert pages - in_nav - linked == set()


def test_the_metrics_page_names_every_metric_the_package_logs():
    from bapo_trl.core import metrics

    text = (REPO / "docs" / "metrics.md").read_text()
    missing = [name for names in metrics.REGISTRY.values() for name in names
               if f"`{name}`" not in text and "/age_" not in name]
    assert missing == []


def test_the_layout_table_names_every_module_of_the_package():
    """CONTRIBUTING's 'Project layout' table stays true: every module and subpackage of bapo_trl appears in it."""
    section = (REPO / "CONTRIBUTING.md").read_text().split("## Project layout")[1].split("\n## ")[0]
    package = REPO / "bapo_trl"
    for path in sorted(package.iterdir()):
        if path.name.startswith("_") or path.name == "__pycache__":
            continue
        name = f"bapo_trl/{path.name}" + ("/" if path.is_dir() else "")
        assert f"`{name}`" in section, f"{name} is missing from CONTRIBUTING's Project layout"


def test_the_readme_leads_with_the_drop_in_table_as_its_study_computes_it_from_the_stored_runs():
    """The first box's table (issue 64) is exactly what ``benchmarks/dropin_study.py --readme`` prints from the
    committed runs files: a number typed by hand, or a rerun that changes a cell, fails here."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dropin_study

    box = README[README.index("## Should you use it?"): README.index("## Install and run")]
    assert "\n".join(dropin_study.readme_table(dropin_study.both_tasks())) in box


def test_the_readme_is_a_front_door():
    """At most ~250 lines, nothing dated, no commit hashes."""
    assert len(README.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README)
    assert not re.search(r"\b(commit|code at) [0-9a-f]{7,}\b", README)


#: Docstring markup that reached the built HTML unrendered (outside <pre> blocks): a backtick, TRL's ``*optional*``,
#: a Hugging Face link (``[`X`]``, ``[~x.Y]``) or a Sphinx role (``:class:`X```).
RAW_MARKUP = re.compile(r"`|\*optional\*|\[<code>[^<]*</code>\]|\[~|"
                        r":(?:py:)?(?:class|func|meth|mod|attr|obj|data|exc):<code>")


def raw_markup(html: str) -> list[str]:
    text = re.sub(r"<(pre|script)\b.*?</\1>", "", html, flags=re.S)
    return [text[max(0, m.start() - 60): m.end() + 40] for m in RAW_MARKUP.finditer(text)]


def test_the_raw_markup_check_finds_what_an_unrendered_trl_docstring_leaves():
    """What the API page held before TRL-style docstrings were rewritten (an excerpt of that build)."""
    before = ('<p>Configuration for [<code>BAPOTrainer</code>]: every [<code>~trl.GRPOConfig</code>] field (:mod:'
              '<code>bapo_trl.generation.fleet</code>)</p>'
              '<td><code>`float`, *optional*, defaults to `0.5`</code></td>')
    assert len(raw_markup(before)) == 8  # 2 links, 1 role, 4 backticks, *optional*
    assert raw_markup("<p>within [<code>target_min</code>, <code>target_max</code>]</p><pre>`x`</pre>") == []


@pytest.mark.parametrize("annotation, cleaned", [
    ("`float`, *optional*, defaults to `0.5`", "float"),
    ("`int` or `None`, *optional*, defaults to `None`", "int | None"),
    ('`str`, *optional*, defaults to `"paper"`', "str"),
    ("*optional*", ""),
    ("float", "float"),
    ("list[str] | None", "list[str] | None"),
])
def test_trl_style_parameter_annotations_become_types(annotation, cleaned):
    assert script_module("mkdocs_hooks").clean_annotation(annotation) == cleaned


def test_trl_style_docstrings_are_rewritten_for_the_google_parser():
    """Parameter lines, Hugging Face links and Sphinx roles of BAPOConfig's docstring, as griffe (mkdocstrings'
    loader, which the hook imports) loads it."""
    hooks = script_module("mkdocs_hooks")
    griffe = hooks.griffe
    package = griffe.load("bapo_trl", search_paths=[str(REPO)], extensions=griffe.load_extensions(
        hooks.TRLDocstrings))
    config = package["trainer.bapo_config.BAPOConfig"]
    text = config.docstring.value
    assert "*optional*" not in text and not hooks.HF_LINK.search(text) and not hooks.SPHINX_ROLE.search(text)
    assert "    positive_contribution_target (float):" in text
    assert "[`GRPOConfig`](https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig)" in text
    assert '<autoref identifier="bapo_trl.trainer.bapo_trainer.BAPOTrainer" optional>' in text
    assert '<autoref identifier="bapo_trl.rollout.settings.RolloutSettings" optional>' in text
    sections = config.docstring.parse("google")  # mkdocs.yml's docstring_style
    parameters = {p.name: p for s in sections if s.kind.value == "parameters" for p in s.value}
    assert str(parameters["positive_contribution_target"].annotation) == "float"
    assert str(parameters["target_entropy"].annotation) == "float | None"


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_the_documentation_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing, a docstring mkdocstrings cannot read or the
    generated field reference failing fails it. No page holds raw docstring markup (TRL-style docstrings are rewritten
    by scripts/mkdocs_hooks.py), and the field tables' names break only at ``_``."""
    mkdocs = shutil.which("mkdocs") or os.path.join(os.path.dirname(sys.executable), "mkdocs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert '<code class="cell-name">replay_<wbr>buffer_<wbr>size</code>' in reference
    reference = reference.replace("<wbr>", "")
    assert "replay_buffer_size" in reference and "positive_contribution_target" in reference
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert 'href="https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig"' in api
    assert 'href="#bapo_trl.trainer.bapo_trainer.BAPOTrainer"><code>BAPOTrainer</code></a>' in api
    raw = {str(page.relative_to(tmp_path / "site")): found for page in sorted((tmp_path / "site").rglob("*.html"))
           if (found := raw_markup(page.read_text()))}
    assert raw == {}, raw


def test_the_suites_time_is_written_in_one_place_and_linked_from_the_others():
    """Issue 77 (6): the suite's time was given three ways (README ~35-40 min, docs/install.md ~30, CONTRIBUTING 30.1).
    It is written only in docs/data/ci_durations.md (generated from a CI log); each other place links it."""
    import re

    pages = {"README.md": "docs/data/ci_durations.md", "docs/install.md": "data/ci_durations.md",
             "CONTRIBUTING.md": "docs/data/ci_durations.md"}
    for page, link in pages.items():
        text = (REPO / page).read_text()
        assert link in text, page
        test_lines = [line for line in text.splitlines() if re.search(r"make test|test suite|fast tier", line)]
        assert not [line for line in test_lines if re.search(r"\d\s*(min|minutes)\b", line)], (page, test_lines)


#: A user's script, saved where the README's layout puts them: the clone's root, beside ``.venv``.
SCRIPT_BESIDE_THE_VENV = """
import os, sys
import bapo_trl
from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

assert os.path.dirname(bapo_trl.__file__) == os.path.join(os.getcwd(), "bapo_trl"), bapo_trl.__file__
args = BAPOConfig(output_dir="out", max_steps=1, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
BAPOTrainer(model=sys.argv[1], reward_funcs=reverse_reward, args=args, train_dataset=make_reverse_dataset(16)).train()
print("trained")
"""


def clone_of_the_working_tree(folder):
    """What ``git clone`` puts in ``folder`` that an import can see: the package (copied from the working tree, so the
    test reads the code under test)."""
    folder.mkdir(parents=True)
    shutil.copytree(REPO / "bapo_trl", folder / "bapo_trl", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_the_readme_layout_imports_and_trains_a_script_saved_beside_the_venv(tmp_path, tiny_model_dir):
    """Issue 77 (2): the README's block clones into ``bapo-trl`` with the venv inside; a script saved there, beside
    ``.venv``, imports the package and trains (one step of the embedded task)."""
    assert "git clone <url of this repository> bapo-trl && cd bapo-trl" in README
    assert "python3 -m venv .venv" in README
    clone = clone_of_the_working_tree(tmp_path / "bapo-trl")
    (clone / ".venv").mkdir()
    (clone / "train.py").write_text(SCRIPT_BESIDE_THE_VENV)
    done = subprocess.run([sys.executable, "train.py", tiny_model_dir], cwd=clone, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0 and done.stdout.strip().endswith("trained"), done.stderr[-3000:]


def test_the_install_page_quotes_the_error_a_clone_named_like_the_package_gives_and_the_way_out(tmp_path):
    """Issue 77 (2): where the shadowing can still happen (a clone named ``bapo_trl``, a script in the folder that
    holds it; Python's own error, which the package cannot reword since it is not the package Python loads), the
    install page quotes the error exactly as Python prints it today, and says what to do."""
    clone_of_the_working_tree(tmp_path / "bapo_trl" / "bapo_trl")
    done = subprocess.run([sys.executable, "-c", "from bapo_trl import BAPOConfig"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "(unknown location)" in last, done.stderr
    page = (REPO / "docs" / "install.md").read_text()
    section = page.split("## If `from bapo_trl import BAPOConfig` fails")[1].split("\n## ")[0]
    assert f"```text\n{last}\n```" in section and "mv bapo_trl bapo-trl" in section


def test_the_docs_home_page_has_an_example_and_a_figure_of_its_own():
    """Issue 77 (9): the site's first page shows the swap in code, a command, and a figure that exists."""
    page = (REPO / "docs" / "index.md").read_text()
    assert "```python\nfrom bapo_trl import BAPOConfig, BAPOTrainer" in page and "`bapo train " in page
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert figures and all((REPO / "docs" / figure).is_file() for figure in figures), figures


def test_the_readme_async_table_is_what_the_study_computes_from_its_committed_runs():
    """Issue 76: the README's async table is exactly ``benchmarks/async_anchor_study.py report --readme`` on the
    committed runs (docs/data/async_anchor_runs.jsonl.gz), as docs/async.md shows it too."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import async_anchor_study as study

    runs = [study.compact(r) for r in study.read_jsonl(str(REPO / "docs" / "data" / "async_anchor_runs.jsonl.gz"))]
    lines = "\n".join(study.readme_table(runs, study.parse_seeds(study.README_SEEDS, count=False)))
    assert lines in README
    assert lines in (REPO / "docs" / "async.md").read_text()


def test_the_version_the_docs_show_is_the_packages():
    """``bapo --version``'s output as the README and the install page show it is this checkout's version (a release
    bumps ``__version__``; these comments had stayed behind once)."""
    from bapo_trl import __version__

    for page in ("README.md", "docs/install.md"):
        shown = re.findall(r"^bapo --version\s+# bapo_trl (\S+?)[;\s]", (REPO / page).read_text(), flags=re.M)
        assert shown == [__version__], (page, shown)
