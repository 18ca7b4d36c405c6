#!/usr/bin/env bash
# Where a kernel's warps wait: Nsight Compute stall reasons and shared-memory pipe use, one bench case per line of
# arguments ("case|profile_case.py options", e.g. "dsv3|" or "small tree|--target sm_120").
# Device machine, repository root; output under $OUT.
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels, or the packed site (as tools/gpu_session.sh takes them)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
elif [ -f .whl/site312.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .whl/site312.tar.xz -C /tmp/site || exit
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
N=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); N=${N:-ncu}
R=smsp__average_warps_issue_stalled
M=$(for s in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected dispatch_stall lg_throttle membar branch_resolving no_instruction misc sleeping tex_throttle drain imc_miss; do printf "%s_%s_per_issue_active.ratio," $R $s; done)
M="${M}smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_ldsm.sum,sm__cycles_elapsed.avg,gpu__time_duration.sum,lts__t_sector_hit_rate.pct"
for spec in "$@"; do
  c=${spec%%|*}; extra=${spec#*|}
  echo "######## $c $extra"
  timeout 120 $N --clock-control none -k verify_mla_fwd --launch-skip 3 --launch-count 1 --metrics "$M" python3 tools/profile_case.py "$c" $extra 2>&1 | grep -v "^==PROF==" | grep -E "stalled|pct|sum|avg|ratio|verify|config" | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
done 2>&1 | tee $OUT/stalls.txt
