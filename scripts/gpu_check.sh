#!/usr/bin/env bash
# The first thing to run on a machine with NVIDIA GPUs, with the JAX it already has:
#   pip install -e . --no-deps   # beside the preinstalled jax/flax/optax/orbax (add grain if missing)
#   bash scripts/gpu_check.sh [OUT_DIR]
# It prints the stack and the devices, then for every tiny config plans the sections over the
# GPUs found (`maestro-jax plan`, the memory each GPU has) and runs `verify` (maestro vs the
# monolithic step: loss, grads, updated params), then `bench` on a GPU-sized VLM (monolithic vs
# naive vs wavefront, side by side). Reports go to OUT_DIR (default gpu_check/).
# A section plan needs 2+ devices; with one GPU, `verify` runs on 8 virtual CPU devices and
# `bench` is skipped (say so in RESULTS.md). GPU_CHECK_PLATFORM=cpu runs the whole script on 8
# virtual CPU devices (how the script itself is tested).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
mkdir -p "$out"
mj=${MAESTRO_JAX:-"python -m maestro_jax.cli"}
if [[ "${GPU_CHECK_PLATFORM:-}" == cpu ]]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8"
fi

python - <<'EOF' | tee "$out/stack.txt"
import importlib.metadata as md
import jax
for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint", "grain"):
    try:
        print(f"{pkg:20s} {md.version(pkg)}")
    except md.PackageNotFoundError:
        pass
d = jax.devices()
print(f"backend {jax.default_backend()}: {len(d)} x {d[0].device_kind}")
EOF
read -r n mem < <(python -c "
import jax
d = jax.devices()
stats = d[0].memory_stats() or {}
print(len(d), round(stats.get('bytes_limit', 16 * 2**30) / 2**30 * 0.9, 1))")
echo "devices: $n, planning with ${mem} GB per device"

status=0
run() {  # run a command, tee its output, remember a failure
  echo "+ $*" | tee -a "$out/log.txt"
  "$@" 2>&1 | tee -a "$out/log.txt"
  local rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { echo "FAILED ($rc): $*" | tee -a "$out/summary.txt"; status=1; }
  return "$rc"
}

for cfg in vlm_tiny kd_tiny omni_tiny vlm_kd_tiny; do
  if [[ $n -ge 2 ]]; then
    run $mj plan --config "configs/$cfg.yaml" --devices "$n" --memory-gb "$mem" --top 1 \
        --write "$out/$cfg.plan.yaml" "host_devices=$n" "monolithic.devices=0:$n" "monolithic.mesh={data: $n}" \
        "monolithic.micro_batch=1" &&
      run $mj verify --config "$out/$cfg.plan.yaml" && echo "verify $cfg on $n devices: ok" >> "$out/summary.txt"
  else
    JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8" run $mj verify --config "configs/$cfg.yaml" &&
      echo "verify $cfg on 8 virtual CPU devices (one GPU cannot host a section plan): ok" >> "$out/summary.txt"
  fi
done

# a GPU-sized VLM: 300M-parameter LLM, 90M-parameter ViT, 64 samples per step
GPU_VLM=(global_batch=64 "host_devices=$n" models.llm.width=1024 models.llm.depth=12 models.llm.heads=16
         models.llm.kv_heads=8 models.llm.head_dim=64 models.llm.mlp=4096 models.llm.vocab=32000
         models.vision.width=768 models.vision.depth=12 models.vision.heads=12 models.vision.mlp=3072
         models.vision.out_width=1024 models.vision.patch=14 models.vision.merge=2
         data.text_len=[128,512] "data.modalities.image.sizes=[[224,224],[448,224],[448,448]]"
         data.modalities.image.max_items=2 data.num_samples=4096
         "monolithic.devices=0:$n" "monolithic.mesh={data: $n}" monolithic.micro_batch=1)
if [[ "${GPU_CHECK_PLATFORM:-}" == cpu ]]; then  # the script's own test: the tiny VLM stands in
  GPU_VLM=("host_devices=$n" "monolithic.devices=0:$n" "monolithic.mesh={data: $n}" monolithic.micro_batch=1)
fi
if [[ $n -ge 2 ]]; then
  run $mj plan --config configs/vlm_tiny.yaml --devices "$n" --memory-gb "$mem" --top 3 \
      --write "$out/vlm_gpu.plan.yaml" "${GPU_VLM[@]}" &&
    run $mj bench --config "$out/vlm_gpu.plan.yaml" --json "$out/bench_vlm_gpu.json" &&
    echo "bench vlm_gpu on $n devices: see $out/bench_vlm_gpu.json" >> "$out/summary.txt"
else
  echo "bench skipped: one device cannot host a section plan" | tee -a "$out/summary.txt"
fi
echo "=== summary ($out/summary.txt)"
cat "$out/summary.txt"
exit $status
