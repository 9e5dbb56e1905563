#!/usr/bin/env bash
# The GPU column of docs/speed.md, and the CPU-specific choices rechecked on
# the same machine's host CPU, in one go.
#
#   bash benchmarks/gpu_host.sh OUTDIR NAME [SECONDS]
#
# Two lanes run side by side, each on half of the host's cores (taskset), so
# that the GPU lane's compiles and host work do not share cores with the CPU
# lane's timed runs:
#   GPU lane: partial_rollout.py --workload long_tail, then
#             sampler.py --part length;
#   CPU lane (JAX_PLATFORMS=cpu): rl_iteration.py (the train step's CPU
#             compiler option against XLA's defaults), sampler.py --part peer
#             (with Tunix's sampler when it is installed), then
#             rl_iteration.py --baseline layer_loop.
# Every benchmark writes OUTDIR/<benchmark>_NAME[_cpuN].json, each lane one
# log (OUTDIR/gpu_lane_NAME.log, cpu_lane_NAME.log); a benchmark still running
# when SECONDS (default 540) have passed is stopped, and the ones that
# finished keep their JSON.
set -u
out=${1:?usage: gpu_host.sh OUTDIR NAME [SECONDS]}
name=${2:?usage: gpu_host.sh OUTDIR NAME [SECONDS]}
budget=${3:-540}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}"
deadline=$(( $(date +%s) + budget ))

cores=$(nproc)
half=$(( cores / 2 ))
gpu_cpus="0-$(( half - 1 ))"
cpu_cpus="$half-$(( cores - 1 ))"
pin() {  # pin CPUS CMD...: run on those cores when taskset exists
  local cpus=$1; shift
  if command -v taskset >/dev/null && (( cores > 1 )); then
    taskset -c "$cpus" "$@"
  else
    "$@"
  fi
}

bench() {  # bench CPUS TAG SCRIPT ARGS...: one benchmark, within the deadline
  local cpus=$1 tag=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  if (( left < 20 )); then
    echo "[$tag] skipped: $left s left"
    return
  fi
  local start=$(date +%s)
  echo "[$tag] $*"
  pin "$cpus" timeout "$left" "$py" "$here/$@" --json "$out/$tag.json" 2>&1
  echo "[$tag] rc $? in $(( $(date +%s) - start )) s"
}

gpu_lane() {
  bench "$gpu_cpus" "partial_rollout_long_tail_$name" \
    partial_rollout.py --workload long_tail
  bench "$gpu_cpus" "sampler_length_$name" sampler.py --part length
}

cpu_lane() {
  local n=$(( cores - half ))
  export JAX_PLATFORMS=cpu
  bench "$cpu_cpus" "rl_iteration_${name}_cpu$n" rl_iteration.py
  bench "$cpu_cpus" "sampler_peer_${name}_cpu$n" sampler.py --part peer
  bench "$cpu_cpus" "rl_iteration_layer_loop_${name}_cpu$n" \
    rl_iteration.py --baseline layer_loop
}

{
  echo "host: $cores cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$out/gpu_lane_$name.log"

gpu_lane >>"$out/gpu_lane_$name.log" 2>&1 &
cpu_lane >"$out/cpu_lane_$name.log" 2>&1 &
wait
grep -h '^\[' "$out"/*_lane_"$name".log
echo "done in $(( budget - (deadline - $(date +%s)) )) s"
