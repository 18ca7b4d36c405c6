#!/usr/bin/env bash
# Everything the GPU is needed for, in one call (build, test, sanitize, benchmark); logs under $OUT.
# Usage (device machine, repository root): tools/gpu_session.sh [smoke|quick|test|bench|bench-sm120|bench-chain|bench-chain-fa2|bench-ref|variants|tensor-rate|notebooks|sglang|sglang-captures|sglang-bench|server-check|server-tests|bench-server|wheel|gpu-suite|gpu-suite-fuzz|gpu-suite-kernel|gpu-suite-rest|ngram-cost|selfcheck|tune|tune-default|tune-sm120|tune-sm120-half|report|all] ...
# (bench-chain: the chain cases with FlashInfer's causal MLA kernel beside kdtree; carry .whl/fi312.tar.xz alone)
# (bench-chain-fa2: sm_120's configuration against FlashInfer's portable fa2 kernel, first as its dispatch sizes it
#  for this GPU, then on a copy of FlashInfer edited to take the branch it takes at sm_120's ~100 KB a SM; carry
#  .whl/fi312.tar.xz alone)
# (bench-ref: the kernel of an earlier commit, `git archive <commit> kdtree kernels` unpacked in ref-<commit>/, carried)
# (tensor-rate: the sm_120 configuration and 64 rows with Q in registers, each beside the same kernel with every MMA
#  issued twice, a part with half this GPU's mma.sync rate per SM-cycle, on every bench case; the ceilings of both)
# (server-check: `kdtree server-check` with the real sgl_kernel when .whl/sgl_kernel312.tar.xz is carried, else the
#  test stand-in; SERVER_CHECK_ARGS adds options; carry .whl with site312.tar.xz and leave data/ behind;
#  server-tests: tests/test_server_gpu.py the same way, SERVER_TESTS_K selects tests; bench-server: `kdtree bench
#  --server` into $OUT, BENCH_SERVER_ARGS adds options; at TP 2, on two GPUs: SERVER_CHECK_ARGS="--tp 2
#  --model-dir /tmp/tiny-model-tp2", BENCH_SERVER_ARGS="--tp 2 --heads 8")
# (wheel: kdtree from its wheel (.dist/kdtree-*.whl, carried: `make wheel && cp -r dist .dist`) installed in
#  /tmp/kd-site, outside the checkout, and run from /tmp with no checkout on PYTHONPATH: `kdtree selfcheck` on the
#  CUDA kernel, then `kdtree server-check`, its plugin found through the installed entry point; carry .whl too)
# (selfcheck, tune (this GPU's target, sm_120's, sm_120's at half the tensor rate), report: the first-use
#  commands of kdtree; tune writes no tuning file here)
# (gpu-suite: `pytest -m gpu` without the live-server tests, as three parts (-fuzz, -kernel, -rest: one call each);
#  GPU_SUITE_K selects; PYTEST_WORKERS > 0 runs pytest-xdist's workers where .whl/extra holds it)
# (several words run several parts, in that order; smoke stops everything if the kernel fails the shipped captures;
#  quick: the shipped captures, the fused merge and determinism tests only)
set -uo pipefail
# the parts, as the usage line names them: a word that is none of them stops the call before anything runs
PARTS=" $(sed -n '3s/.*\[\(.*\)\].*/\1/p' "${BASH_SOURCE[0]}" | tr '|' ' ') "
for w in "$@"; do
  [[ $w != *[[:space:]]* && "$PARTS" == *" $w "* ]] || { echo "gpu_session.sh: no part named '$w' (the parts:$PARTS)" >&2; exit 2; }
done
OUT=$(mkdir -p "${OUT:-gpu-out}" && cd "${OUT:-gpu-out}" >/dev/null && pwd) || exit 1  # absolute: bench-ref runs elsewhere
if ls .whl/*.whl >/dev/null 2>&1; then   # carried wheels (SGLang and what its import chain needs)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
elif [ -f .whl/site312.tar.xz ]; then    # ... or those wheels installed here for cp312 and packed (xz: 17 MB, not 50; tools/pack_sglang.sh)
  mkdir -p /tmp/site && tar -xJf .whl/site312.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
fi
if ls .whl/extra/*.whl >/dev/null 2>&1; then  # pure-Python test tools (pytest-xdist, execnet: tools/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/extra/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# the repository, and tests/ for the sgl_kernel stand-in (tests/sglang_harness) the sglang-* scripts import
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/tests" PYTHONUNBUFFERED=1
# pytest's workers where PYTEST_WORKERS > 0 and pytest-xdist was carried (one process by default: on an H100 six
# workers got through a third of the GPU suite in ten minutes, no faster than one process; docs/history/house.md)
workers() { [ "${PYTEST_WORKERS:-0}" != 0 ] && python3 -c "import xdist" 2>/dev/null && echo "-n $PYTEST_WORKERS"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/nvidia-smi.txt" 2>&1
# kdtree installed in place, for its `sglang.srt.plugins` entry point (SGLang finds `--attention-backend kdtree` so)
install_plugin() { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/pip-e.log" 2>&1 \
  || echo "install_plugin: pip install -e . failed ($OUT/pip-e.log): SGLang will not find --attention-backend kdtree"; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n 25 "$OUT/$name.log"; echo "== $name rc=$rc ($((SECONDS - t0)) s)"
  return $rc; }
[ "${SKIP_COMPILE:-0}" = 1 ] || step compile 120 python3 -m kdtree compile --arch sm_90 --arch sm_120
for w in "$@"; do [ "$w" = all ] && set -- smoke test; done
[ $# -eq 0 ] && set -- smoke test
for w in "$@"; do
  case $w in
    smoke) step diff 120 python3 -m kdtree diff data/captured_batches/*.safetensors --impl cuda \
             || { echo "smoke failed: stopping"; exit 1; }
           step bench 360 python3 -m kdtree bench -o "$OUT" ;;
    quick) step diff 120 python3 -m kdtree diff data/captured_batches/*.safetensors --impl cuda
           step quick 240 python3 -m pytest -q -x tests/test_kernel_gpu.py -k "fused or shipped or shared_memory or deterministic" ;;
    bench) step bench 240 python3 -m kdtree bench -o "$OUT" ;;
    bench-sm120) step bench-sm120 240 python3 -m kdtree bench -o "$OUT/sm120" --target sm_120 ;;
    bench-chain|bench-chain-fa2) [ -f .whl/fi312.tar.xz ] && mkdir -p /tmp/site && { [ -d /tmp/site/flashinfer ] || tar -xJf .whl/fi312.tar.xz -C /tmp/site; } \
                   && export PYTHONPATH="/tmp/site:$PYTHONPATH"  # FlashInfer for cp312, when carried (tools/pack_flashinfer.sh)
                 export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PATH="$PATH:/usr/local/cuda/bin" \
                   FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # its JIT's nvcc, for the H200
                 if [ "$w" = bench-chain ]; then
                   step test-flashinfer 330 python3 -m pytest -q -rs tests/test_kernel_gpu.py -k flashinfer
                   step bench-chain 300 python3 -m kdtree bench --chain -o "$OUT/chain"
                 else
                   fa2=(python3 -m kdtree bench --chain --no-sglang --target sm_120 --flashinfer-backend fa2)
                   step bench-chain-fa2 200 "${fa2[@]}" -o "$OUT/fa2"
                   # a copy of FlashInfer whose MLA dispatch takes the branch it takes at sm_120's ~100 KB a SM
                   # (92,672 <= smem < 147,968 B), with a JIT cache of its own; /tmp/site stays as shipped
                   rm -rf /tmp/site-99k /tmp/fi-99k-cache && mkdir -p /tmp/site-99k && cp -r /tmp/site/flashinfer /tmp/site-99k/
                   mla=/tmp/site-99k/flashinfer/data/include/flashinfer/attention/mla.cuh
                   sed -i 's/smem_limit_per_sm >= 221696/smem_limit_per_sm >= 100000000/; s/smem_limit_per_sm >= 147968/smem_limit_per_sm >= 100000001/' "$mla"
                   if grep -q "smem_limit_per_sm >= 100000001" "$mla"; then
                     diff /tmp/site/flashinfer/data/include/flashinfer/attention/mla.cuh "$mla" > "$OUT/fa2-99k-header.diff"
                     step bench-chain-fa2-99k 200 env PYTHONPATH="/tmp/site-99k:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE=/tmp/fi-99k-cache \
                       "${fa2[@]}" -o "$OUT/fa2-99k"
                   else
                     echo "bench-chain-fa2-99k: FlashInfer's shared-memory thresholds not found in $mla: not run"
                   fi
                 fi ;;
    bench-ref) ref=$(ls -d ref-*/ 2>/dev/null | head -n 1)  # an earlier commit's kdtree/ and kernels/ (git archive), carried
               [ -n "$ref" ] && (cd "$ref" && step bench-ref 240 python3 -m kdtree bench -o "$OUT/ref" --no-sglang) ;;  # (python -m imports from the working directory first)
    test) step test-gpu 570 python3 -m pytest -q $(workers) tests/test_kernel_gpu.py tests/test_kernel_plan.py ;;
    gpu-suite|gpu-suite-fuzz|gpu-suite-kernel|gpu-suite-rest)
               # every gpu-marked test but the live servers' (server-tests), in three parts of at most ~9 minutes
               # each on an H100: one call each (`gpu-suite` runs all three, for a machine without a call limit);
               # GPU_SUITE_K selects within a part (a part it leaves empty ends rc=5, pytest's "no tests")
               suite=(python3 -m pytest -q -rs $(workers) -m gpu) k=${GPU_SUITE_K:+ and ($GPU_SUITE_K)}
               case $w in gpu-suite|gpu-suite-fuzz)
                 step gpu-suite-fuzz "${GPU_SUITE_LIMIT:-580}" "${suite[@]}" tests/test_kernel_gpu.py -k "test_fuzz$k" ;; esac
               case $w in gpu-suite|gpu-suite-kernel)
                 step gpu-suite-kernel "${GPU_SUITE_LIMIT:-580}" "${suite[@]}" tests/test_kernel_gpu.py -k "not test_fuzz$k" ;; esac
               case $w in gpu-suite|gpu-suite-rest)
                 install_plugin  # SGLang's kit and the backend's tests find the backend by its entry point
                 step gpu-suite-rest "${GPU_SUITE_LIMIT:-580}" "${suite[@]}" tests --ignore tests/test_kernel_gpu.py \
                   --ignore tests/test_server_gpu.py ${GPU_SUITE_K:+-k "$GPU_SUITE_K"} ;; esac ;;
    variants) step variants 300 python3 tools/variants.py --json "$OUT/variants.json" ;;
    tensor-rate) step tensor-rate 420 python3 tools/variants.py --mma-ceilings --repeat 3 --cases "" \
                   --variants sm120 bm64_regs --mma-repeat 1 2 --json "$OUT/tensor-rate.json" ;;
    notebooks) [ -f .whl/nbsite312.tar.xz ] && mkdir -p /tmp/site && tar -xJf .whl/nbsite312.tar.xz -C /tmp/site \
                 && export PYTHONPATH="/tmp/site:$PYTHONPATH"  # the notebook stack for cp312, when carried (tools/pack_notebooks.sh)
               step notebooks 420 python3 -m pytest -q -rs tests/test_notebooks.py ;;
    sglang) install_plugin
            step sglang-imports 300 python3 tools/sglang_imports.py
            step test-sglang 540 python3 -m pytest -q -rs tests/test_sglang_gpu.py tests/test_serving_gpu.py ;;
    sglang-captures) step sglang-captures 300 python3 tools/sglang_captures.py "$OUT" ;;
    sglang-bench) step sglang-bench 420 python3 tools/sglang_bench.py "$OUT/bench-sglang.json" ;;
    server-check) install_plugin
                  if [ -f .whl/sgl_kernel312.tar.xz ]; then   # the real sgl_kernel (tools/pack_sgl_kernel.sh)
                    tar -xJf .whl/sgl_kernel312.tar.xz -C /tmp/site
                  else                                       # else the test stand-in, in every server process
                    export PYTHONPATH="$PWD/tests/sglang_harness/site:$PYTHONPATH" SGLANG_FORCE_FUSED_OP_BACKEND=torch \
                      SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
                  fi
                  step server-check "${SERVER_CHECK_LIMIT:-560}" python3 -m kdtree server-check -o /tmp/server-check \
                    --model-dir /tmp/tiny-model ${SERVER_CHECK_ARGS:-}
                  cp /tmp/server-check/report.json "$OUT/" 2>/dev/null  # and the servers' logs and captures in one archive:
                  tar -cJf "$OUT/server-check.tar.xz" -C /tmp/server-check . 2>/dev/null ;;
    wheel) [ -f .whl/sgl_kernel312.tar.xz ] && tar -xJf .whl/sgl_kernel312.tar.xz -C /tmp/site
           rm -rf /tmp/kd-site /tmp/elsewhere && mkdir -p /tmp/elsewhere \
             && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kd-site .dist/kdtree-*.whl \
             || { echo "wheel: no .dist/kdtree-*.whl to install"; exit 1; }
           wheel_env=(env -C /tmp/elsewhere PYTHONPATH=/tmp/kd-site:/tmp/site KDTREE_CACHE_DIR=/tmp/kd-cache PATH="/tmp/kd-site/bin:$PATH")
           "${wheel_env[@]}" python3 -c "import kdtree, kdtree.kernel.config as c; print('kdtree', kdtree.__file__, 'kernels', c.KERNEL_DIR)" \
             | tee "$OUT/wheel-where.txt"
           step wheel-selfcheck 300 "${wheel_env[@]}" kdtree selfcheck
           step wheel-server-check "${SERVER_CHECK_LIMIT:-560}" "${wheel_env[@]}" kdtree server-check -o /tmp/server-check \
             --model-dir /tmp/tiny-model ${SERVER_CHECK_ARGS:-}
           cp /tmp/server-check/report.json "$OUT/" 2>/dev/null
           tar -cJf "$OUT/server-check.tar.xz" -C /tmp/server-check . 2>/dev/null ;;
    selfcheck) step selfcheck 300 python3 -m kdtree selfcheck --force ;;
    ngram-cost) step ngram-cost 240 python3 experiments/ngram_cost.py "$OUT/ngram-cost.json" ;;  # SGLang's drafter, host only
    tune|tune-default|tune-sm120|tune-sm120-half)
          # the three bars of the tuner: this GPU's configurations, sm_120's, and sm_120's at half the tensor rate
          # (every mma.sync issued twice), each timed and fitted twice (--repeat 2); `tune` runs all three
          tune=(python3 -m kdtree tune --repeat 2 --holdout 20 --no-write)
          case $w in tune|tune-default) step tune 560 "${tune[@]}" -o "$OUT/tune" ;; esac
          case $w in tune|tune-sm120) step tune-sm120 560 env KDTREE_KERNEL_TARGET=sm_120 "${tune[@]}" -o "$OUT/tune-sm120" ;; esac
          case $w in tune|tune-sm120-half) step tune-sm120-half 560 env KDTREE_KERNEL_TARGET=sm_120 "${tune[@]}" \
                                             -o "$OUT/tune-sm120-half" --mma-repeat 2 ;; esac ;;
    report) step report 600 python3 -m kdtree report -o "$OUT/report" ;;
    bench-server) install_plugin
                  [ -f .whl/sgl_kernel312.tar.xz ] && tar -xJf .whl/sgl_kernel312.tar.xz -C /tmp/site
                  step bench-server "${BENCH_SERVER_LIMIT:-560}" python3 -m kdtree bench --server -o /tmp/bench-server ${BENCH_SERVER_ARGS:-}
                  cp /tmp/bench-server/bench-server.json /tmp/bench-server/bench-server.png "$OUT/" 2>/dev/null
                  (cd /tmp/bench-server && tar -cJf "$OUT/bench-server-logs.tar.xz" ./*.log 2>/dev/null) ;;
    server-tests) install_plugin
                  if [ -f .whl/sgl_kernel312.tar.xz ]; then tar -xJf .whl/sgl_kernel312.tar.xz -C /tmp/site
                  else export PYTHONPATH="$PWD/tests/sglang_harness/site:$PYTHONPATH" SGLANG_FORCE_FUSED_OP_BACKEND=torch \
                         SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1; fi
                  export KDTREE_SERVER_TEST_OUT=/tmp/server-tests
                  step server-tests "${SERVER_TESTS_LIMIT:-560}" python3 -m pytest -q -rs -s tests/test_server_gpu.py -k "${SERVER_TESTS_K:-}"
                  (cd /tmp/server-tests && tar -cJf "$OUT/server-tests.tar.xz" --exclude=model --exclude='captures*' \
                     ./*.log ./*.json ship 2>/dev/null) ;;
  esac
done
