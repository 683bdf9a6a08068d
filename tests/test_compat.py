"""The 0.1 import paths keep working for one release: each is the module it became (one object), with a
DeprecationWarning naming the new path; ``python -m <old path>`` runs the new command; ``bapo_trl.config`` stays for
good, silently, since every saved run's ``training_args.bin`` pickles ``bapo_trl.config.BAPOConfig``."""

import importlib
import pickle
import re
import subprocess
import sys
import warnings

import pytest
import torch

from bapo_trl import _compat
from support.launching import REPO

#: one old path per kind of move (the whole table is checked by test_every_old_path_resolves)
SAMPLES = [("bapo_trl.clipping", "bapo_trl.core.clipping"), ("bapo_trl.loss_hook", "bapo_trl.trainer.loss_hook"),
           ("bapo_trl.rollout_settings", "bapo_trl.rollout.settings"),
           ("bapo_trl.toy.task", "bapo_trl.recipes.toy.task"),
           ("bapo_trl.math_recipe.rewards", "bapo_trl.recipes.math_reasoning.rewards"),
           ("bapo_trl.plot", "bapo_trl.cli.plot"), ("bapo_trl.generation.serve", "bapo_trl.cli.serve"),
           ("bapo_trl.rollout.queue", "bapo_trl.rollout.replay_queue"),
           ("bapo_trl.cli.summary", "bapo_trl.trainer.summary")]


def fresh(name: str):
    """Import ``name`` as a first import would (its old-path entry dropped from ``sys.modules``),
    recording warnings."""
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old, new", SAMPLES)
def test_an_old_path_is_the_new_module_and_warns_with_its_name(old, new):
    module, caught = fresh(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # the import system's bookkeeping names the real module
    assert [w for w in caught if f"{old} moved to {new};" in str(w.message)]  # (its parent package may warn too)


def test_the_plot_commands_library_names_still_answer_from_its_module():
    """``bapo_trl.cli.plot`` is the command now; the callback it held answers there with a warning naming its place,
    and the figure's functions (which the command imports) without one."""
    from bapo_trl.cli import plot
    from bapo_trl.trainer import callbacks, dynamics

    with pytest.warns(DeprecationWarning, match="bapo_trl.cli.plot.PlotDynamicsCallback moved to "
                                                "bapo_trl.trainer.callbacks.PlotDynamicsCallback"):
        assert plot.PlotDynamicsCallback is callbacks.PlotDynamicsCallback
    assert plot.plot_dynamics is dynamics.plot_dynamics and plot.load_run is dynamics.load_run


def test_every_old_path_resolves():
    for old in [*_compat.MOVED, *_compat.SPLIT]:
        assert fresh(old)[0] is not None, old


def test_a_split_module_answers_with_both_halves():
    models, caught = fresh("bapo_trl.models")
    from bapo_trl.cli import models as command
    from bapo_trl.recipes import models as registry

    assert models.prepare_model is registry.prepare_model and models.main is command.main
    assert caught and "bapo_trl.recipes.models and bapo_trl.cli.models" in str(caught[0].message)


def test_the_config_path_stays_silently_and_unpickles_a_saved_config():
    config, caught = fresh("bapo_trl.config")
    from bapo_trl import BAPOConfig

    assert config.BAPOConfig is BAPOConfig and caught == []
    # what training_args.bin of every 0.1 run holds: the class by its 0.1 path
    saved = pickle.dumps(BAPOConfig, protocol=0).replace(b"bapo_trl.trainer.bapo_config\n", b"bapo_trl.config\n")
    assert b"cbapo_trl.config\n" in saved and pickle.loads(saved) is BAPOConfig
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        args = torch.load(REPO / "tests" / "data" / "checkpoints_0a2653b" / "async" / "training_args.bin",
                          weights_only=False)
    assert type(args) is BAPOConfig and args.async_generation


def test_the_old_trainer_module_names_warn():
    import bapo_trl.trainer as trainer
    from bapo_trl.core.metrics import ENTROPY_CLIP, REPLAY, SEARCH, UPDATE

    with pytest.warns(DeprecationWarning, match="bapo_trl.trainer.BAPO_METRICS moved to "
                                                "bapo_trl.core.metrics.UPDATE"):
        assert trainer.BAPO_METRICS is UPDATE
    assert UPDATE == SEARCH + ENTROPY_CLIP  # the names 0.1's BAPO_METRICS held
    with pytest.warns(DeprecationWarning, match="bapo_trl.trainer.REPLAY_METRICS moved to "
                                                "bapo_trl.core.metrics.REPLAY"):
        assert trainer.REPLAY_METRICS is REPLAY


def test_python_m_of_an_old_command_runs_the_new_one():
    proc = subprocess.run([sys.executable, "-m", "bapo_trl.plot", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m bapo_trl.cli.plot ")
    assert "python -m bapo_trl.plot moved to python -m bapo_trl.cli.plot" in proc.stderr


def test_the_rollout_face_exports_what_a_source_author_needs_and_warns_for_internal_names():
    import bapo_trl.rollout as rollout
    from bapo_trl.rollout.replay_queue import ReplayQueue

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a public name: no warning at all
        public = {name: getattr(rollout, name) for name in rollout.__all__}
    assert {"RolloutSource", "TrainerPort", "register_source", "SourceSettings"} <= set(public)
    assert not {"ReplayQueue", "TRLPort", "build_source"} & set(rollout.__all__)
    with pytest.warns(DeprecationWarning, match=r"import it from bapo_trl\.rollout\.replay_queue"):
        assert rollout.ReplayQueue is ReplayQueue  # 0.1 code keeps working until 0.2


@pytest.mark.parametrize("module, old, new", [
    ("bapo_trl.generation.vllm_generation", "CPUServerVLLMGeneration", "BAPOVLLMGeneration"),
    ("bapo_trl.trainer.vllm_backend", "CPUServerSyncMixin", "VLLMGenerationMixin"),
])
def test_the_vllm_classes_0_1_names_still_import_with_a_warning(module, old, new):
    """The vLLM backend lost the "CPU" in its names (it serves CUDA, colocate mode, LoRA and seeds too): the 0.1
    names are the same classes until 0.2, each use warning with the new name."""
    imported = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(module)}\.{old} moved to {re.escape(module)}\.{new}"):
        assert getattr(imported, old) is getattr(imported, new)


def test_the_vllm_backends_0_1_module_still_answers_its_0_1_name():
    from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration

    cpu_server, _ = fresh("bapo_trl.generation.cpu_server")
    with pytest.warns(DeprecationWarning, match="CPUServerVLLMGeneration moved to"):
        assert cpu_server.CPUServerVLLMGeneration is BAPOVLLMGeneration


def test_the_project_itself_never_imports_a_deprecated_path():
    """Old paths are for users' code: the package, its benchmarks, tests, notebooks and scripts use the new ones (a
    study script written against 0.1 paths warned on every run, and `python -m` of a module that lost its command
    silently did nothing)."""
    old = sorted({*_compat.MOVED, *_compat.SPLIT} - set(_compat.PERMANENT), key=len, reverse=True)
    pattern = re.compile(r"(?:from|import|-m)\s+[\"']?(" + "|".join(map(re.escape, old)) + r")(?![\w])")
    module_flag = re.compile(r"\"-m\", \"(" + "|".join(map(re.escape, old)) + r")\"")
    files = [*REPO.glob("bapo_trl/**/*.py"), *REPO.glob("benchmarks/*.py"), *REPO.glob("tests/*.py"),
             *REPO.glob("tests/support/*.py"), *REPO.glob("notebooks/*.ipynb"), *REPO.glob("scripts/*"),
             REPO / "train_bapo.py", REPO / "Makefile"]
    found = []
    for path in files:
        if path.name in ("test_compat.py", "_compat.py") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for match in (*pattern.finditer(text), *module_flag.finditer(text)):
            found.append(f"{path.relative_to(REPO)}:{text[:match.start()].count(chr(10)) + 1}: {match.group(1)}")
    assert found == [], "\n".join(found)


def test_every_module_the_project_runs_with_python_m_has_a_command():
    """``python -m bapo_trl.recipes.models`` imports the functions and exits 0 having done nothing: a test that runs a
    module that way must name one with a command (``if __name__ == "__main__"``, or a package's ``__main__.py``)."""
    named = set()
    for path in [*REPO.glob("tests/*.py"), *REPO.glob("tests/support/*.py"), *REPO.glob("benchmarks/*.py"),
                 *REPO.glob("bapo_trl/**/*.py"), *REPO.glob("scripts/*"), REPO / "Makefile", REPO / "README.md"]:
        if path.is_file() and path.name != "test_compat.py":
            named |= set(re.findall(r"-m[\"', ]+(bapo_trl(?:\.\w+)+)", path.read_text(errors="replace")))
    assert "bapo_trl.cli.models" in named  # the scan finds the forms in use
    silent = []
    for module in sorted(named - set(_compat.MOVED) - set(_compat.SPLIT)):
        file = REPO / (module.replace(".", "/") + ".py")
        package_main = REPO / module.replace(".", "/") / "__main__.py"
        if package_main.is_file():
            continue
        if not file.is_file() or '__name__ == "__main__"' not in file.read_text():
            silent.append(module)
    assert silent == []
