#!/usr/bin/env bash
# Issue 76's confirmation (docs/data/async_anchor_protocol.md, with its amendment): seeds 800-819, seed by seed, the
# study's runs with the code they started with (3fe3820) and the probe's (4a5211e), each from a worktree of its own
# beside this checkout. Resumable: each harness skips the runs in its raw file, which starts as the runs committed
# here. Rewards are cut from the progress lines: the confirmation is read once, when all 20 seeds are in.
#   bash benchmarks/async_anchor_confirm.sh            # OUT=outputs/async_anchor: confirm.jsonl, probe_confirm.jsonl
#   touch $OUT/confirm.jsonl.pause $OUT/probe_confirm.jsonl.pause    # pause between two runs (rm to go on)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-outputs/async_anchor}")
STUDY=$(realpath -m ../bapo-confirm-study) PROBE=$(realpath -m ../bapo-confirm-probe)
[ -d "$STUDY" ] || git worktree add --detach "$STUDY" 3fe3820
[ -d "$PROBE" ] || git worktree add --detach "$PROBE" 4a5211e
mkdir -p "$OUT"
[ -s "$OUT/confirm.jsonl" ] || zcat docs/data/async_anchor_runs.jsonl.gz > "$OUT/confirm.jsonl"
[ -s "$OUT/probe_confirm.jsonl" ] || zcat docs/data/async_anchor_probe_runs.jsonl.gz > "$OUT/probe_confirm.jsonl"
# The CPU each pass ran on (the rows do not record it; another CPU kind changes seconds per step): one line per start.
echo "$(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), torch CPU capability" \
  "$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" >> "$OUT/machines.log"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false BAPO_TRL_EXPERIMENTAL_SILENCE=1
quiet() { grep --line-buffered -Ev '^(\||#|$|heldout|Paired|Each)' | sed -u 's/, reward .*//'; }
in_tree() { (cd "$1" && shift && PYTHONPATH="$PWD" BAPO_STUDY_COMMIT=$(git rev-parse HEAD) python "$@" | quiet); }
for seed in $(seq 800 819); do
  in_tree "$STUDY" benchmarks/async_anchor_study.py run --seeds "$seed-$seed" --results "$OUT/confirm.jsonl"
  for probe in heldout-5120 heldout-30s; do
    tasks=reverse3,reverse2-8; [ "$probe" = heldout-30s ] && tasks=reverse2-8
    in_tree "$PROBE" benchmarks/async_anchor_study.py probe --seeds "$seed-$seed" --probe "$probe" --tasks "$tasks" \
      --configs "TRL defaults,dapo clip-higher" --trainers "TRL sync,BAPO async K=1,TRL async" \
      --results "$OUT/probe_confirm.jsonl"
  done
done
