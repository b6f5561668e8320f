#!/bin/bash
# One call on a lent GPU (issue 64): the CUDA-only tests, then bench/gpu.py on the same card, one variant after the
# other: `before` (4c0d8a8: eager torch ops), `previous` (b27ea9f: CUDA graphs + Triton attention), `after` (this
# checkout: + fused layer kernels), the first two once, `after` twice (about 7-8 minutes in all).
# Needs .before/ and .previous/ carried along: `git archive <commit> specserve ':!specserve/drafts'
# ':!specserve/data' | tar -x -C .before && echo <commit> > .before/COMMIT` (same for .previous); call it as
# `SPECSERVE_COMMIT=<this checkout's> bash ...` (the device's copy of the tree has no .git), so that run/meta.json
# names every commit. Writes under $OUT: gpu.txt, tests.txt, bench.log and run/{rows.jsonl,table.md,identity.json,
# meta.json,host_profile.txt} (8 files: the device returns 8 at most).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/model/test_gpu_fused.py \
    tests/model/test_gpu_attention.py tests/engine/test_cuda_graphs.py 2>&1 | tail -40 | tee $OUT/tests.txt
if grep -q "^FAILED\|^ERROR" $OUT/tests.txt; then
    # the new kernels and graphs are the first suspects: measure the rest rather than nothing
    export SPECSERVE_GPU_FUSED=0 SPECSERVE_GRAPH_PREFILL=0
    echo "a test failed: measured with SPECSERVE_GPU_FUSED=0 SPECSERVE_GRAPH_PREFILL=0" | tee -a $OUT/gpu.txt
fi
timeout ${BENCH_S:-450} python3 bench/gpu.py --out $OUT/run --variants ${VARIANTS:-before,previous,after} \
    --once ${ONCE:-before,previous} --profile --identity --host-profile --repeats ${REPEATS:-2} ${BENCH_ARGS:-} 2>&1 \
    | grep -v "^{" | tee $OUT/bench.log
cat $OUT/run/table.md 2>/dev/null || cat $OUT/run/rows.jsonl
