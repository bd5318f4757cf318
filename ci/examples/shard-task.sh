#!/usr/bin/env bash
# One shard of a ninfer-perplexity run, as a task of a job array (docs/sharding.md).
#
#   shard-task.sh OUTDIR ARTIFACT [EVALUATOR FLAGS...]
#
# Scores shard I of N into OUTDIR/shard-I, with I and N from the scheduler:
#   Slurm job array  (sbatch --array=1-N):  SLURM_ARRAY_TASK_ID, _MIN and _COUNT
#   Kubernetes Indexed Job (completions N): JOB_COMPLETION_INDEX (0-based) and SHARDS=N
# Afterwards: ninfer-perplexity merge OUTDIR/shard-* --output OUTDIR/merged
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: $0 OUTDIR ARTIFACT [FLAGS...]" >&2
    exit 2
fi
out=$1
shift
if [[ -n "${SLURM_ARRAY_TASK_ID:-}" ]]; then
    # Any contiguous array (1-8 or 0-7) works; a stepped one (1-8:2) does not.
    i=$((SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-1} + 1))
    n=${SLURM_ARRAY_TASK_COUNT:?SLURM_ARRAY_TASK_COUNT is unset: run under sbatch --array}
elif [[ -n "${JOB_COMPLETION_INDEX:-}" ]]; then
    i=$((JOB_COMPLETION_INDEX + 1))
    n=${SHARDS:?set SHARDS to the number of completions of the Indexed Job}
else
    echo "$0: neither SLURM_ARRAY_TASK_ID nor JOB_COMPLETION_INDEX is set (not an array task)" >&2
    exit 2
fi
exec "${NINFER_PERPLEXITY:-ninfer-perplexity}" "$@" --shard "$i/$n" --output "$out/shard-$i"
