#!/usr/bin/env bash
# Run N maestro-jax processes on this machine, each with 8/N virtual CPU devices, joined by
# jax.distributed (gloo collectives, socket transfers). Process 0 writes metrics.
#   scripts/launch_local.sh 2 configs/kd_tiny.yaml steps=4 output_dir=/tmp/mp
# Extra arguments are the command's options and key=value overrides. The command is `train`;
# MAESTRO_COMMAND names another that runs on devices, e.g. the teacher cache:
#   MAESTRO_COMMAND=teacher-cache scripts/launch_local.sh 2 configs/kd_tiny.yaml --out /tmp/cache
# If any process fails, the others are stopped.
set -euo pipefail
n=${1:?usage: launch_local.sh N CONFIG [option or key=value ...]}
config=${2:?usage: launch_local.sh N CONFIG [option or key=value ...]}
shift 2
# the coordinator's port and the N transfer ports after it, below Linux's ephemeral range (32768 on),
# where outgoing connections would take them
port=${MAESTRO_PORT:-$((20000 + RANDOM % 12000))}
per=$((8 / n))
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for ((i = 0; i < n; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=$per" ${MAESTRO_JAX:-maestro-jax} "${MAESTRO_COMMAND:-train}" \
    --config "$config" --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" "$@" "host_devices=$per" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do
  if ! wait "$p"; then status=1; cleanup; fi
done
exit $status
