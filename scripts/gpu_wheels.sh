#!/usr/bin/env bash
# Wheels for the GPU machine (benchmarks/gpu_check.py): exactly the packages it lacks, for its Python 3.12 on
# manylinux x86_64, into .gpu_wheels/ (ignored by git). That machine has no internet and only 64 MiB of files travel
# with the working tree; it has CUDA PyTorch, transformers, accelerate, peft, pandas, pyarrow, matplotlib, xxhash,
# msgpack, ninja, py-cpuinfo, einops, psutil (and their own needs), but no trl, datasets or deepspeed.
#
#   bash scripts/gpu_wheels.sh                 # download / build into .gpu_wheels/, print sizes, check the limit
#   bash scripts/gpu_wheels.sh --list          # only print what it would fetch (name==version, how), no network
#   bash scripts/gpu_wheels.sh --dest DIR      # somewhere else
#   bash scripts/gpu_wheels.sh ... pyarrow==26.0.1   # extra binary wheels, e.g. where the machine's are too old
#   GPU_PYTHON_VERSION=3.11 bash scripts/gpu_wheels.sh  # for another Python (a rehearsal on this machine)
#
# Versions are those of $PYTHON's environment (default: python), so the GPU machine runs what CI tests. Binary
# wheels come from PyPI with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform ...`;
# DeepSpeed ships only a source archive, so it is built here into a pure-Python wheel (DS_BUILD_OPS=0: its ops
# are compiled on the GPU machine, just in time, by its nvcc); bapo_trl is built from this checkout.
# On the GPU machine (see benchmarks/gpu_check.py's docstring):
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_site .gpu_wheels/*.whl
#   export PYTHONPATH=$PWD:/tmp/gpu_site
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
PY_VERSION="${GPU_PYTHON_VERSION:-3.12}"
CP_TAG="cp${PY_VERSION/./}"
DEST=".gpu_wheels"
LIMIT_MIB=64
LIST=0
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --list) LIST=1 ;;
        --dest) DEST="$2"; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        -*) echo "unknown option: $1" >&2; exit 2 ;;
        *) EXTRA+=("$1") ;;
    esac
    shift
done

# What the GPU machine lacks: trl and datasets with datasets' missing needs (dill, multiprocess); deepspeed with its
# missing needs (hjson, pydantic and pydantic's: pydantic-core, annotated-types, typing-inspection, and a
# typing-extensions new enough for them); then this package. Also the versions CI tests of what the machine has
# older or unpinned (transformers: 5.17 there in 2026-11; peft; fsspec, which datasets caps), so the seams
# checked at import are the ones CI checks.
BINARY=(trl datasets dill multiprocess hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
        transformers peft fsspec)
SOURCE=(deepspeed)

pinned() {  # name==version of each distribution as installed for $PYTHON (fails naming any that is missing)
    "$PYTHON" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"gpu_wheels.sh: not installed for {sys.executable}: {' '.join(missing)} (install the project's "
             "test extras: pip install -e '.[test,deepspeed]')")
EOF
}

mapfile -t BINARY_SPECS < <(pinned "${BINARY[@]}")
mapfile -t SOURCE_SPECS < <(pinned "${SOURCE[@]}")
BINARY_SPECS+=("${EXTRA[@]}")
SELF_VERSION="$("$PYTHON" -c 'import bapo_trl; print(bapo_trl.__version__)')"

if [ "$LIST" = 1 ]; then
    for spec in "${BINARY_SPECS[@]}"; do echo "$spec binary"; done
    for spec in "${SOURCE_SPECS[@]}"; do echo "$spec built-from-sdist"; done
    echo "bapo_trl==$SELF_VERSION built-from-checkout"
    exit 0
fi

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
echo "downloading ${#BINARY_SPECS[@]} binary wheels for CPython $PY_VERSION, manylinux x86_64 ..."
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$DEST" "${BINARY_SPECS[@]}"
echo "building ${SOURCE_SPECS[*]} from source (pure Python, ops built later by the GPU machine's nvcc) ..."
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --no-binary=:all: -w "$DEST" \
    "${SOURCE_SPECS[@]}"
echo "building bapo_trl $SELF_VERSION from this checkout ..."
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" .

"$PYTHON" - "$DEST" "$LIMIT_MIB" "$CP_TAG" <<'EOF'
import subprocess, sys
from pathlib import Path
dest, limit, cp = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
wheels = sorted(dest.glob("*.whl"))
bad = [w.name for w in wheels if not (w.name.endswith("-none-any.whl") or f"-{cp}-{cp}-manylinux" in w.name)]
total = sum(w.stat().st_size for w in wheels)
for w in wheels:
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
tree = sum(Path(f.decode()).stat().st_size for f in files if f and Path(f.decode()).is_file())
print(f"{total / 2**20:8.2f} MiB  total, {len(wheels)} wheels in {dest}/; with the tracked working tree "
      f"({tree / 2**20:.2f} MiB): {(total + tree) / 2**20:.2f} of {limit:.0f} MiB")
if bad:
    sys.exit(f"gpu_wheels.sh: wheels neither for {cp} manylinux x86_64 nor for any platform: {bad}")
if total + tree > limit * 2**20:
    sys.exit(f"gpu_wheels.sh: over the {limit:.0f} MiB that can travel to the GPU machine")
EOF
