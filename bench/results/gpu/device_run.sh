#!/bin/bash
# One call on a lent GPU (issue 64): the CUDA-only tests, then bench/gpu.py before/after on the same card
# (2026-11-28-a ran it with one repeat and no phase times; it now takes ~8 minutes with REPEATS=2).
# Needs .before/ carried along: `git archive <commit> specserve ':!specserve/drafts' ':!specserve/data' | tar -x
# -C .before && echo <commit> > .before/COMMIT`; call it as `SPECSERVE_COMMIT=<this checkout's> bash ...` (the
# device's copy of the tree has no .git), so that run/meta.json names both. Writes under $OUT: gpu.txt, tests.txt,
# bench.log and run/{rows.jsonl,table.md,identity.json,meta.json} (7 files: the device returns 8 at most).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout ${TESTS_S:-120} python3 -m pytest -q -x -p no:cacheprovider tests/model/test_gpu_attention.py \
    tests/engine/test_cuda_graphs.py 2>&1 | tail -40 | tee $OUT/tests.txt
timeout ${BENCH_S:-480} python3 bench/gpu.py --out $OUT/run --variants ${VARIANTS:-before,after} --profile --identity \
    --repeats ${REPEATS:-2} ${BENCH_ARGS:-} 2>&1 | grep -v "^{" | tee $OUT/bench.log
cat $OUT/run/table.md 2>/dev/null || cat $OUT/run/rows.jsonl
