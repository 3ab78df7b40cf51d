"""Knowledge distillation: a Qwen2 teacher (frozen) into a smaller Qwen2 student, both started from
Hugging Face folders, the student exported back as one.

    python examples/distill_qwen.py --workdir /tmp/distill    # 8 virtual CPU devices

What it does (config: examples/distill_qwen.yaml):
1. `hf/teacher`, `hf/student`: tiny random Qwen2 folders (`examples/tiny_hf.py`; put real ones
   there instead, and set `models.*` in the YAML to their shapes).
2. `maestro-jax train`: the teacher section runs the teacher's body (forward only, its weights
   frozen), the student section the student and the loss alpha*T^2*KL + (1-alpha)*CE against the
   teacher's logits. The data here is synthetic text; for your own, convert text or conversations
   with `scripts/convert_dataset.py` and set `data: {kind: array_record, paths: [...]}`.
3. `maestro-jax export`: the trained student as a Qwen2 folder.

From a shell: `maestro-jax train --config examples/distill_qwen.yaml output_dir=W/run
sections.teacher.init.hf_path=W/hf/teacher sections.student.init.hf_path=W/hf/student`, then
`maestro-jax export` with the same arguments and `--section student --out W/export/student --model-type qwen2`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts its backend

import maestro_jax as mj
from maestro_jax import cli

CONFIG = Path(__file__).resolve().parent / "distill_qwen.yaml"


def make_folders(hf: dict[str, Path]) -> None:
    """Random teacher and student folders. The teacher is frozen in the KD workload (its weights
    are constants, not parameters), so its folder is written from a student of the teacher's shape."""
    from tiny_hf import write_random_folders

    cfg = mj.load_config(CONFIG, ["sections.teacher.init=null", "sections.student.init=null"])
    write_random_folders(cfg, {"student": hf["student"]}, seed=1)
    teacher_shaped = mj.load_config(
        CONFIG,
        ["sections.teacher.init=null", "sections.student.init=null", "sections.student.mesh={data: 2, tensor: 2}"]
        + [f"models.student.{k}={v}" for k, v in cfg.models["teacher"].model_dump().items() if v is not None],
    )
    write_random_folders(teacher_shaped, {"student": hf["teacher"]}, seed=2)


def main(work: Path) -> dict:
    """The whole recipe under `work`; returns the metrics and the paths it wrote."""
    work = Path(work).absolute()
    hf = {"teacher": work / "hf/teacher", "student": work / "hf/student"}
    make_folders(hf)
    overrides = [f"output_dir={work / 'run'}"] + [f"sections.{s}.init.hf_path={path}" for s, path in hf.items()]
    history = mj.Trainer(mj.load_config(CONFIG, overrides)).train(progress=False)
    export = work / "export/student"
    args = ["export", "--config", str(CONFIG), *overrides, "--section", "student", "--out", str(export)]
    if status := cli.main(args + ["--model-type", "qwen2"]):
        raise SystemExit(status)
    print(f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}; student exported to {export}")
    return {"history": history, "hf": hf, "export": export, "overrides": overrides}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/distill_qwen"))
    main(ap.parse_args().workdir)
