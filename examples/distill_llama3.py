"""Knowledge distillation the Llama 3 way: a Llama 3.1-style teacher (frozen) into a smaller
Llama 3.2-style student, both read from Hugging Face folders, the student exported back as one.

    python examples/distill_llama3.py --workdir /tmp/distill    # 8 virtual CPU devices

What it does (config: examples/distill_llama3.yaml):
1. `hf/teacher`, `hf/student`: tiny random Llama folders in Llama 3's layout (grouped-query
   attention, RoPE theta 500000 with Llama 3.1's `llama3` scaling; the student's embeddings tied,
   as Llama 3.2 1B's are). Put real ones there instead (Llama-3.1-70B and Llama-3.2-1B): the
   config reads every architecture field from their config.json (`models.<s>: {hf: DIR}`).
2. `maestro-jax train`: the teacher section runs the teacher's body (forward only, its weights
   frozen), the student section the student and the loss alpha*T^2*KL + (1-alpha)*CE against the
   teacher's logits. The data here is synthetic text; for your own, convert text or conversations
   with `scripts/convert_dataset.py` and set `data: {kind: array_record, paths: [...]}`.
3. `maestro-jax export`: the trained student as a Llama folder, then, where transformers is
   installed (the `reference` extra), `maestro-jax check-hf` on it: transformers and maestro give
   the same logits.

From a shell: `maestro-jax train --config examples/distill_llama3.yaml output_dir=W/run
models.teacher.hf=W/hf/teacher models.student.hf=W/hf/student`, then `maestro-jax export` with the
same arguments and `--section student --out W/export/student`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts its backend

import maestro_jax as mj
from maestro_jax import cli

CONFIG = Path(__file__).resolve().parent / "distill_llama3.yaml"
LLAMA3_ROPE = {  # Llama 3.1's
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {  # tiny stand-ins for Llama-3.1-70B (teacher) and Llama-3.2-1B (student)
    "teacher": {"vocab": 256, "width": 64, "depth": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "mlp": 128},
    "student": {"vocab": 256, "width": 32, "depth": 1, "heads": 2, "kv_heads": 1, "head_dim": 16, "mlp": 64},
}


def make_folders(hf: dict[str, Path]) -> None:
    """Random Llama 3-style folders, written with the project's exporter (`models.hf.save_llm`)."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn
    from maestro_jax.models import DecoderLM, LLMConfig
    from maestro_jax.models import hf as hf_io

    for i, (name, folder) in enumerate(hf.items()):
        fields = {
            **SHAPES[name],
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_ROPE,
            "norm_eps": 1e-5,
            "tie_embeddings": name == "student",
            "qkv_bias": False,
        }
        model = DecoderLM(LLMConfig.from_fields(fields))
        ids = jnp.zeros((1, 4), jnp.int32)
        params = nn.unbox(model.init(jax.random.key(i), ids, jnp.arange(4)[None], jnp.ones((1, 4), bool))["params"])
        hf_io.save_llm(folder, jax.device_get(params), {**fields, "qk_norm": False}, model_type="llama")


def main(work: Path) -> dict:
    """The whole recipe under `work`; returns the metrics and the paths it wrote."""
    work = Path(work).absolute()
    hf = {"teacher": work / "hf/teacher", "student": work / "hf/student"}
    make_folders(hf)
    overrides = [f"output_dir={work / 'run'}"] + [f"models.{s}.hf={path}" for s, path in hf.items()]
    history = mj.Trainer(mj.load_config(CONFIG, overrides)).train(progress=False)
    export = work / "export/student"
    args = ["export", "--config", str(CONFIG), *overrides, "--section", "student", "--out", str(export)]
    if status := cli.main(args):
        raise SystemExit(status)
    print(f"loss {history[0]['train/loss']:.3f} -> {history[-1]['train/loss']:.3f}; student exported to {export}")
    checked = None
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        checked = cli.main(["check-hf", "--hf", str(export)])  # 0: transformers gives maestro's logits
        if checked:
            raise SystemExit(checked)
    return {"history": history, "hf": hf, "export": export, "overrides": overrides, "checked": checked}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/distill_llama3"))
    main(ap.parse_args().workdir)
