"""Every generation-server command the docs give would start: a dry run, no GPU, nothing launched.

Found in README.md and docs/*.md (bash blocks) and in every recipe (comments included, continuation lines joined):
``trl vllm-serve ...``, ``bapo serve ...`` and ``python -m bapo_trl.cli.serve ...``. Each is parsed by the
parser that would run it (the installed TRL's ``vllm-serve`` parser, imported from ``trl.scripts.vllm_serve``
without starting anything; the project's own for ``bapo serve``), turned into the ``vllm serve`` command line that
would be executed, and checked against vLLM's rule for dense models (:func:`vllm_parallelism_error`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from support.launching import REPO

#: Hub models the docs name, MoE or not (a hub id missing here fails the test: classify it).
HUB_MODELS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "dense",
    "Qwen/Qwen2.5-0.5B-Instruct": "dense",
    "Qwen/Qwen2.5-1.5B-Instruct": "dense",
    "Qwen/Qwen3-30B-A3B": "moe",  # not in the docs: the rule's MoE case, checked below
}
#: config.json keys that only mixture-of-experts models set (to a number > 1)
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
SERVER_PREFIXES = (["trl", "vllm-serve"], ["bapo", "serve"], ["python", "-m", "bapo_trl.cli.serve"])


def vllm_parallelism_error(vllm_argv: list[str], moe: bool) -> str | None:
    """vLLM's rule on a ``vllm serve`` command line: ``--data-parallel-size`` (``-dp``) above 1 is refused unless the
    model is a mixture of experts. TRL 1.16's own ``trl vllm-serve --help`` says so for ``--data_parallel_size``:
    "For dense models, keep this at 1. Setting this above `1` for dense models is not supported/useful and will error
    out (see vLLM PR #30739)". Use ``--tensor_parallel_size`` (``--tensor-parallel-size``) to spread a dense model
    over several GPUs."""
    size = 1
    for i, arg in enumerate(vllm_argv):
        if arg in ("--data-parallel-size", "-dp") and i + 1 < len(vllm_argv):
            size = int(vllm_argv[i + 1])
        elif arg.startswith("--data-parallel-size="):
            size = int(arg.split("=", 1)[1])
    if size > 1 and not moe:
        return (f"--data-parallel-size {size} for a dense model: vLLM refuses data parallelism for dense models; "
                "use --tensor_parallel_size instead")
    return None


def model_is_moe(model: str) -> bool:
    """From the model's config.json when it is a local directory, else from :data:`HUB_MODELS`. Placeholders
    (``MODEL``), registry names and local paths that do not exist here count as dense models."""
    path = Path(os.path.expanduser(model))
    if (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
        return any((config.get(key) or 0) > 1 for key in MOE_CONFIG_KEYS)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith(("~", ".", "/")):
        assert model in HUB_MODELS, f"the docs name {model}: add it to HUB_MODELS as 'dense' or 'moe'"
        return HUB_MODELS[model] == "moe"
    return False


def _bash_lines(text: str) -> list[str]:
    """Lines of the bash blocks of a markdown text, continuations joined, comments cut; a variable the block
    exports earlier (``export VLLM_API_KEY=...``) is written before each later command as ``VAR=value``."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        exports = ""
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("export "):
                exports += line.removeprefix("export ").strip() + " "
            elif line and not line.startswith("#"):
                lines.append(exports + line)
    return lines


def _comment_lines(text: str) -> list[str]:
    """A YAML file's comment lines, ``#`` removed, continuations joined (commands live in the comments)."""
    comments = [line.strip()[1:] for line in text.splitlines() if line.strip().startswith("#")]
    return [" ".join(line.split()) for line in "\n".join(comments).replace("\\\n", " ").splitlines()]


def server_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every server command in README.md, docs/*.md and recipes/*.yaml."""
    found = []
    sources = [(REPO / "README.md", _bash_lines)] + [(p, _bash_lines) for p in sorted((REPO / "docs").glob("*.md"))]
    sources += [(p, _comment_lines) for p in sorted((REPO / "recipes").glob("*.yaml"))]
    for path, lines in sources:
        for line in lines(path.read_text()):
            for prefix in SERVER_PREFIXES:
                if " ".join(prefix) in line:
                    found.append((str(path.relative_to(REPO)), line[line.index(" ".join(prefix)) - len(
                        _env_prefix(line, prefix)):].strip()))
                    break
    return found


def _env_prefix(line: str, prefix: list[str]) -> str:
    """The ``VAR=value`` assignments written just before the command (``CUDA_VISIBLE_DEVICES=6,7 trl ...``)."""
    head = line[: line.index(" ".join(prefix))]
    match = re.search(r"((?:\w+=\S*\s+)*)$", head)
    return match.group(1) if match else ""


def vllm_command(command: str) -> tuple[list[str], str, dict[str, str]]:
    """Parse a documented server command with the parser that would run it; return the ``vllm serve`` argv it would
    execute, the model, and the environment assignments written before it. Raises (SystemExit / ValueError) where
    that parser refuses the command."""
    argv = shlex.split(command.rstrip("&").strip())
    env = {}
    while argv and re.fullmatch(r"\w+=.*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    if argv[:2] == ["trl", "vllm-serve"]:
        from trl.scripts.vllm_serve import build_command, make_parser

        script_args, unknown = make_parser(prog="trl vllm-serve").parse_args_and_config(
            argv[2:], return_remaining_strings=True)
        # `trl vllm-serve` forwards unknown flags to `vllm serve` unchecked: the docs use only TRL's own
        assert not unknown, f"flags TRL's parser does not know (forwarded to vllm serve unchecked): {unknown}"
        return build_command(script_args)[3:], script_args.model, env
    from bapo_trl.cli import serve

    rest = argv[2:] if argv[0] == "bapo" else argv[3:]
    extra = rest[rest.index("--") + 1:] if "--" in rest else []
    rest = rest[: rest.index("--")] if "--" in rest else rest
    args = serve.make_parser().parse_args(rest)
    key, extra = serve.api_key_from(extra, args.api_key, environ=env)
    refusal = serve.exposure_error(args.host, args.allow_remote_dev_endpoints, key)
    if refusal:
        raise ValueError(refusal)
    cmd, _ = serve.build_command(args.model, args.host, args.port, "gpu", sys.executable, args.dtype, extra, key)
    return cmd[1:], args.model, env


COMMANDS = server_commands()


def test_the_docs_and_the_recipes_have_server_commands():
    where = {w for w, _ in COMMANDS}
    assert "recipes/bapo_r1_distill_qwen_7b.yaml" in where and "README.md" in where
    kinds = {next(" ".join(p) for p in SERVER_PREFIXES if " ".join(p) in c) for _, c in COMMANDS}
    assert {"trl vllm-serve", "bapo serve"} <= kinds
    assert len(COMMANDS) >= 8


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_every_server_command_parses_and_vllm_would_accept_it(where, command):
    vllm_argv, model, env = vllm_command(command)
    assert vllm_argv[0] == "serve" and vllm_argv[1] == model
    error = vllm_parallelism_error(vllm_argv, model_is_moe(model))
    assert error is None, f"{where}: {command}\n{error}"
    if "CUDA_VISIBLE_DEVICES" in env:  # as many GPUs as the server's workers use
        gpus = len(env["CUDA_VISIBLE_DEVICES"].split(","))
        sizes = [int(vllm_argv[vllm_argv.index(flag) + 1]) if flag in vllm_argv else 1
                 for flag in ("--tensor-parallel-size", "--data-parallel-size")]
        assert gpus == sizes[0] * sizes[1], f"{where}: {command}\n{gpus} GPUs visible, tensor x data parallel {sizes}"


def test_the_rule_cites_trls_own_help_text():
    from trl.scripts.vllm_serve import ScriptArguments

    text = ScriptArguments.__dataclass_fields__["data_parallel_size"].metadata["help"]
    assert "For dense models, keep this at 1" in text and "will error out" in text


@pytest.mark.parametrize("command, refused", [
    ("trl vllm-serve --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --data_parallel_size 2", True),
    ("trl vllm-serve --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --tensor_parallel_size 2", False),
    ("trl vllm-serve --model Qwen/Qwen3-30B-A3B --data_parallel_size 2", False),  # MoE: data parallel is allowed
    ("bapo serve deepseek-ai/DeepSeek-R1-Distill-Qwen-7B -- --data-parallel-size 2", True),
    ("bapo serve deepseek-ai/DeepSeek-R1-Distill-Qwen-7B -- -dp 4", True),
    ("python -m bapo_trl.cli.serve MODEL -- --data-parallel-size=2", True),
    ("bapo serve MODEL -- --tensor-parallel-size 2", False),
    ("bapo serve --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B -- --data-parallel-size 2", True),  # TRL's flag
    ("bapo serve --model=Qwen/Qwen3-30B-A3B -- --data-parallel-size 2", False),
])
def test_the_check_refuses_data_parallelism_for_a_dense_model(command, refused):
    vllm_argv, model, _ = vllm_command(command)
    assert (vllm_parallelism_error(vllm_argv, model_is_moe(model)) is not None) == refused


def test_the_check_refuses_what_the_parsers_refuse():
    with pytest.raises(SystemExit):  # TRL's parser: a bad value
        vllm_command("trl vllm-serve --model M --tensor_parallel_size two")
    with pytest.raises(AssertionError, match="forwarded to vllm serve unchecked"):
        vllm_command("trl vllm-serve --model M --tensor_paralel_size 2")
    with pytest.raises(SystemExit):  # ours: an unknown flag
        vllm_command("bapo serve MODEL --no-such-flag")
    with pytest.raises(ValueError, match="--allow-remote-dev-endpoints"):  # ours: an exposed server without the flag
        vllm_command("VLLM_API_KEY=k bapo serve MODEL --host 0.0.0.0")
    vllm_command("VLLM_API_KEY=k bapo serve MODEL --host 0.0.0.0 --allow-remote-dev-endpoints")


def test_recipe_comments_are_found_across_continuation_lines(tmp_path):
    text = ("# serve it:\n"
            "#   CUDA_VISIBLE_DEVICES=0,1 trl vllm-serve --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B \\\n"
            "#       --data_parallel_size 2 --max_model_len 10240\n"
            "model_name_or_path: x\n")
    line = next(c for c in _comment_lines(text) if "trl vllm-serve" in c)
    assert line.endswith("--data_parallel_size 2 --max_model_len 10240")
    vllm_argv, model, env = vllm_command(line[line.index("CUDA"):])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1"} and vllm_parallelism_error(vllm_argv, model_is_moe(model))


def test_serve_keeps_idle_connections_longer_than_a_training_step(monkeypatch):
    """vLLM closes a keep-alive connection idle 5 s by default; a client reusing it as it closes loses the request
    ("connection reset by peer", seen once in CI). `bapo serve` sets 300 s unless the environment sets its own."""
    from bapo_trl.cli import serve

    monkeypatch.delenv(serve.KEEP_ALIVE_ENV, raising=False)
    for backend in ("cpu", "gpu"):
        _, env = serve.build_command("m", "127.0.0.1", 8000, backend, sys.executable, None, [])
        assert env[serve.KEEP_ALIVE_ENV] == "300"
    monkeypatch.setenv(serve.KEEP_ALIVE_ENV, "42")
    _, env = serve.build_command("m", "127.0.0.1", 8000, "cpu", sys.executable, None, [])
    assert env[serve.KEEP_ALIVE_ENV] == "42"


def _dry_run(capsys, tmp_path, *argv: str) -> str:
    from bapo_trl.cli import serve

    serve.main([*argv, "--backend", "cpu", "--venv", str(tmp_path / "venv"), "--port", "8011"], prog="bapo serve")
    return capsys.readouterr().out


def test_max_loras_without_lora_is_refused_by_name(capsys, tmp_path):
    from bapo_trl.cli import serve

    with pytest.raises(SystemExit) as exit_info:
        serve.main(["org/model", "--dry-run", "--max-loras", "4", "--backend", "cpu", "--venv", str(tmp_path / "v")],
                   prog="bapo serve")
    assert exit_info.value.code == 2 and "--max-loras needs --lora-rank R" in capsys.readouterr().err


def test_serve_takes_the_model_as_trls_model_flag_or_positionally(capsys, tmp_path, monkeypatch):
    """`bapo serve --model M` (TRL's `trl vllm-serve --model M`) is `bapo serve M`; each flag is accepted with
    underscores too (`--dry_run`, `--lora_rank`, `--api_key`, `--allow_remote_dev_endpoints`), as TRL's parser
    accepts both spellings."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    positional = _dry_run(capsys, tmp_path, "org/model", "--dry-run", "--lora-rank", "12", "--api-key", "k",
                          "--host", "0.0.0.0", "--allow-remote-dev-endpoints")
    assert "--model org/model" in positional and "--max-lora-rank 16" in positional
    assert _dry_run(capsys, tmp_path, "--model", "org/model", "--dry-run", "--lora-rank", "12", "--api-key", "k",
                    "--host", "0.0.0.0", "--allow-remote-dev-endpoints") == positional
    assert _dry_run(capsys, tmp_path, "--host", "0.0.0.0", "--model=org/model", "--dry_run", "--lora_rank", "12",
                    "--api_key", "k", "--allow_remote_dev_endpoints") == positional


@pytest.mark.parametrize("argv, message", [
    ([], "the model is required: give it as MODEL or as --model MODEL"),
    (["a/model", "--model", "b/model"], "the model is given twice ('a/model' and --model 'b/model')"),
    (["--model"], "argument --model: expected one argument"),
])
def test_serve_without_a_model_or_with_two_is_one_error_naming_the_flag(argv, message, capsys, tmp_path):
    from bapo_trl.cli import serve

    with pytest.raises(SystemExit) as exit_info:
        serve.main([*argv, "--dry-run"], prog="bapo serve")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"bapo serve: error: {message}" in err and "Traceback" not in err


def test_every_serve_flag_has_both_spellings():
    from bapo_trl.cli import serve
    from bapo_trl.cli.main import both_spellings

    flags = [a.option_strings for a in serve.make_parser()._actions if a.option_strings]
    separated = [f for f in flags if any(c in f[0][2:] for c in "-_")]
    assert len(separated) == 5, separated
    assert all(f == both_spellings(f[0]) for f in separated), separated


def test_a_dry_run_prints_the_registry_models_directory_without_converting_it(capsys, tmp_path, monkeypatch):
    """`bapo serve --model smollm2 --dry-run`: the command names the local checkpoint the registry name resolves to
    (it printed `smollm2` unresolved), and says it is not prepared yet; nothing is converted."""
    from bapo_trl.recipes.models import model_dir

    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path / "cache"))
    out = _dry_run(capsys, tmp_path, "--model", "smollm2", "--dry-run")
    assert f"--model {model_dir('smollm2')}" in out and "--model smollm2 " not in out
    assert "is not prepared yet" in out and not (tmp_path / "cache").exists()
