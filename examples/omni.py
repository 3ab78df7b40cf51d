"""An omni model: a SigLIP vision tower and a Whisper encoder, each with its projector, feeding a
Qwen2 LLM; all three start from Hugging Face folders, the towers stay frozen, the LLM is exported.

    python examples/omni.py --workdir /tmp/omni    # 8 virtual CPU devices

What it does (config: examples/omni.yaml):
1. `hf/`: tiny random SigLIP, Whisper-encoder and Qwen2 folders (`examples/tiny_hf.py`; put real
   ones there instead, and set `models.*` in the YAML to their shapes).
2. `maestro-jax train`: each tower runs only for the samples carrying its modality (synthetic here:
   images, audio clips, both or neither), on its own devices; `optimizer.sections.<tower>.freeze`
   keeps every tower parameter but its projector's (`merger_*`, `out_proj`).
3. `maestro-jax export`: the trained LLM as a Qwen2 folder. The towers were frozen, so `hf/siglip`
   and `hf/whisper` still hold their weights; their projectors are no part of those checkpoints
   and live in the run's checkpoint.

From a shell: `maestro-jax train --config examples/omni.yaml output_dir=W/run
sections.vision.init.hf_path=W/hf/siglip sections.audio.init.hf_path=W/hf/whisper
sections.llm.init.hf_path=W/hf/qwen2`, then `maestro-jax export` with the same arguments and
`--section llm --out W/export/llm --model-type qwen2`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts its backend

import maestro_jax as mj
from maestro_jax import cli

CONFIG = Path(__file__).resolve().parent / "omni.yaml"


def main(work: Path) -> dict:
    """The whole recipe under `work`; returns the metrics and the paths it wrote."""
    from tiny_hf import write_random_folders

    work = Path(work).absolute()
    hf = {"vision": work / "hf/siglip", "audio": work / "hf/whisper", "llm": work / "hf/qwen2"}
    write_random_folders(mj.load_config(CONFIG, [f"sections.{s}.init=null" for s in hf]), hf)
    overrides = [f"output_dir={work / 'run'}"] + [f"sections.{s}.init.hf_path={path}" for s, path in hf.items()]
    history = mj.Trainer(mj.load_config(CONFIG, overrides)).train(progress=False)
    export = work / "export/llm"
    args = ["export", "--config", str(CONFIG), *overrides, "--section", "llm", "--out", str(export)]
    if status := cli.main(args + ["--model-type", "qwen2"]):
        raise SystemExit(status)
    print(f"loss {history[0]['train/loss']:.3f} -> {history[-1]['train/loss']:.3f}; LLM exported to {export}")
    return {"history": history, "hf": hf, "export": export, "overrides": overrides}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/omni"))
    main(ap.parse_args().workdir)
