#!/usr/bin/env bash
# Where the verify kernel's pool rows come from: Nsight Compute's L2 hit rate and DRAM bytes, one bench case per
# argument ("case|profile_case.py options", e.g. "dsv3-tp8 ddtree256 32k x2|--candidates --no-l2").
# Device machine, repository root; output in $OUT/l2.txt.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
N=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); N=${N:-ncu}
M=lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,gpu__time_duration.sum
for spec in "$@"; do
  c=${spec%%|*}; extra=""; [[ $spec == *"|"* ]] && extra=${spec#*|}
  echo "######## $c $extra"
  timeout 120 $N --clock-control none -k verify_mla_fwd --launch-skip 3 --launch-count 1 --metrics "$M" \
    python3 tools/profile_case.py "$c" $extra 2>&1 | grep -v "^==PROF==" | grep -E "lts__|dram__|gpu__|config|Error|error:"
done 2>&1 | tee "${OUT:-.}/l2.txt"
