"""A LLaVA-style VLM trained in two stages: a SigLIP vision tower and its projector feeding a Qwen2
LLM, the tower frozen throughout.

    python examples/llava_vlm.py --workdir /tmp/llava        # 8 virtual CPU devices, a minute or two

What it does, each step through the project's public tools (config: examples/llava_vlm.yaml):
1. `hf/`: tiny random SigLIP and Qwen2 folders (`examples/tiny_hf.py`; put real ones there instead,
   and set `models.*` in the YAML to their shapes).
2. `data/`: 64 generated PNG images, a LLaVA conversation JSON of 48 samples with 1-3 images each,
   a byte-level BPE tokenizer trained offline on its text (specials `<pad>`, `<image>` at id 1,
   `<audio>` at id 2, chat tokens) with a chat template, and the conversion to ArrayRecord with
   `scripts/convert_dataset.py` (only the assistant's turns carry loss).
3. Stage 1 (`maestro-jax train`): only the projector trains; `optimizer.sections.vision.freeze`
   holds every tower parameter and `optimizer.sections.llm.freeze: [".*"]` the whole LLM.
4. Stage 2: projector and LLM train, both sections starting from stage 1's checkpoint
   (`sections.<s>.init.checkpoint_dir`: its params, a fresh optimizer and schedule).
5. `maestro-jax export`: the trained LLM as a Qwen2 folder. The tower was frozen in both stages, so
   `hf/siglip` still holds its weights; the trained projector is no part of a SigLIP checkpoint
   and lives in stage 2's checkpoint.

The same from a shell, after steps 1-2:

    maestro-jax train --config examples/llava_vlm.yaml output_dir=W/stage1 \\
        sections.vision.init.hf_path=W/hf/siglip sections.llm.init.hf_path=W/hf/qwen2 "data.paths=[W/data/train.array_record]"
    maestro-jax train --config examples/llava_vlm.yaml output_dir=W/stage2 "data.paths=[W/data/train.array_record]" \\
        "sections.vision.init={checkpoint_dir: W/stage1/checkpoints}" "sections.llm.init={checkpoint_dir: W/stage1/checkpoints}" \\
        "optimizer.sections.llm.freeze=[]"
    maestro-jax export --config examples/llava_vlm.yaml output_dir=W/stage2 ... --section llm --out W/export/llm --model-type qwen2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts its backend

import numpy as np
from PIL import Image, ImageDraw

import maestro_jax as mj
from maestro_jax import cli

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "llava_vlm.yaml"
CONVERT = HERE.parent / "scripts" / "convert_dataset.py"
TOWER = "(?!merger_).*"  # the vision section's parameters but the projector's (merger_fc1, merger_fc2)
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
SHAPES = ("square", "circle")
SPECIALS = ["<pad>", "<image>", "<audio>", "<|im_start|>", "<|im_end|>"]  # ids 0..4: <image> = 1, <audio> = 2
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_images(folder: Path, count: int = 64) -> list[str]:
    """`count` 16 x 16 PNGs: a coloured square or circle on a grey ground. Returns each image's
    description."""
    folder.mkdir(parents=True, exist_ok=True)
    said = []
    for i in range(count):
        colour, shape, side = list(COLOURS)[i % 4], SHAPES[(i // 4) % 2], 16
        image = Image.new("RGB", (side, side), (128, 128, 128))
        box = (side // 4, side // 4, 3 * side // 4, 3 * side // 4)
        draw = ImageDraw.Draw(image)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
        image.save(folder / f"img{i:02d}.png")
        said.append(f"a {colour} {shape}")
    return said


def make_conversations(said: list[str], count: int = 48) -> list[dict]:
    """LLaVA records: sample i shows 1, 2 or 3 images (one turn, or two rounds of turns)."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(count):
        picks = [int(k) for k in rng.choice(len(said), size=1 + i % 3, replace=False)]
        names = [f"img{k:02d}.png" for k in picks]
        if len(picks) == 1:
            turns = [("human", "<image>\nwhat is in the picture?"), ("gpt", f"{said[picks[0]]}.")]
        elif len(picks) == 2:
            turns = [("human", "compare <image> and <image>."), ("gpt", f"{said[picks[0]]} and {said[picks[1]]}.")]
        else:
            turns = [
                ("human", "<image>\nwhat is in the picture?"),
                ("gpt", f"{said[picks[0]]}."),
                ("human", "and these two: <image> then <image>?"),
                ("gpt", f"{said[picks[1]]}, then {said[picks[2]]}."),
            ]
        records.append({"id": f"s{i}", "image": names, "conversations": [{"from": f, "value": v} for f, v in turns]})
    return records


def make_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on `texts` (offline, with the `tokenizers` library),
    saved as a Hugging Face tokenizer folder with a ChatML-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_data(work: Path) -> Path:
    """Images, conversations and tokenizer under `work/data`, converted; returns the ArrayRecord file."""
    data = work / "data"
    said = make_images(data / "images")
    records = make_conversations(said)
    (data / "llava.json").write_text(json.dumps(records, indent=1))
    texts = [t["value"].replace("<image>", "") for r in records for t in r["conversations"]]
    make_tokenizer(data / "tokenizer", texts)
    out = data / "train.array_record"
    cmd = [sys.executable, str(CONVERT), str(data / "llava.json"), str(out), "--tokenizer", str(data / "tokenizer")]
    cmd += ["--config", str(CONFIG), "--image-root", str(data / "images"), "--strict"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def train(overrides: list[str]) -> list[dict]:
    return mj.Trainer(mj.load_config(CONFIG, overrides)).train(progress=False)


def main(work: Path) -> dict:
    """The whole recipe under `work`; returns each stage's metrics and the paths it wrote."""
    from tiny_hf import write_random_folders

    work = Path(work).absolute()
    hf = {"vision": work / "hf/siglip", "llm": work / "hf/qwen2"}
    random_init = mj.load_config(CONFIG, ["data.kind=synthetic", "sections.vision.init=null", "sections.llm.init=null"])
    write_random_folders(random_init, hf)
    data = make_data(work)
    run = [f"data.paths=[{data}]", f"compile.cache_dir={work / 'compile_cache'}"]  # stage 2 reuses stage 1's programs
    stage1_overrides = (
        run + [f"output_dir={work / 'stage1'}"] + [f"sections.{s}.init.hf_path={p}" for s, p in hf.items()]
    )
    stage1 = train(stage1_overrides)
    stage2_overrides = run + [
        f"output_dir={work / 'stage2'}",
        f"sections.vision.init={{checkpoint_dir: {work / 'stage1/checkpoints'}}}",
        f"sections.llm.init={{checkpoint_dir: {work / 'stage1/checkpoints'}}}",
        "optimizer.sections.llm.freeze=[]",  # stage 2: the LLM trains too; the tower stays frozen
    ]
    stage2 = train(stage2_overrides)
    export = work / "export/llm"
    status = cli.main(
        ["export", "--config", str(CONFIG), *stage2_overrides, "--section", "llm", "--out", str(export)]
        + ["--model-type", "qwen2"]
    )
    if status:
        raise SystemExit(status)
    print(
        f"stage 1 loss {stage1[0]['train/loss']:.3f} -> {stage1[-1]['train/loss']:.3f}; "
        f"stage 2 loss {stage2[0]['train/loss']:.3f} -> {stage2[-1]['train/loss']:.3f}; LLM exported to {export}"
    )
    return {
        "stage1": stage1,
        "stage2": stage2,
        "data": data,
        "hf": hf,
        "export": export,
        "stage1_overrides": stage1_overrides,
        "stage2_overrides": stage2_overrides,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llava_vlm"))
    workdir = ap.parse_args().workdir
    if importlib.util.find_spec("tokenizers") is None:  # the recipe trains its tokenizer, and converts chats
        print(
            "error: this example needs the `tokenizers` package; install the convert extra: pip install "
            "'maestro-jax[convert]'",
            file=sys.stderr,
        )
        sys.exit(2)
    main(workdir)
