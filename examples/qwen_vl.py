"""A Qwen2.5-VL-style fine-tune: a tiny random Qwen2.5-VL folder, conversations converted with its
own image tokens, a few steps with the tower frozen, the VLM exported whole.

    python examples/qwen_vl.py --workdir /tmp/qwen_vl        # 8 virtual CPU devices, a minute or two

What it does, each step through the project's public tools (config: examples/qwen_vl.yaml):
1. `hf/qwen2_5_vl`: a random `Qwen2_5_VLForConditionalGeneration` folder of tiny shapes (`SHAPES`,
   written with the project's exporter, `save_qwen_vl`), with what a checkpoint ships beside
   its weights: a tokenizer (a byte-level BPE trained offline with Qwen's special tokens,
   `<|image_pad|>` at the folder's image_token_id), its chat template (chat_template.json) and
   preprocessor_config.json (patches of 4 merged 2 x 2; min_pixels and max_pixels). Put a real
   folder there instead and skip this step.
2. `data/`: PNG images of different sizes, a LLaVA conversation JSON, converted by
   `scripts/convert_dataset.py --tokenizer hf/qwen2_5_vl`: each image as `<|vision_start|>`, one
   `<|image_pad|>` per merged token of the image as Qwen's processor sizes it, `<|vision_end|>`.
3. `maestro-jax train`: both sections from the folder (`models.<s>: {hf: ..., kind: ...}`), the
   tower frozen but its merger, the LLM trained, on each sample's M-RoPE positions.
4. `maestro-jax export --section vision,llm`: one Qwen2.5-VL folder; where transformers is
   installed (the `reference` extra), `maestro-jax check-hf` on it.

The same from a shell, after steps 1-2:

    maestro-jax train --config examples/qwen_vl.yaml output_dir=W/run "models.vision.hf=W/hf/qwen2_5_vl" \\
        "models.llm.hf=W/hf/qwen2_5_vl" "data.paths=[W/data/train.array_record]"
    maestro-jax export --config examples/qwen_vl.yaml ... --section vision,llm --out W/export/qwen2_5_vl
    maestro-jax check-hf --hf W/export/qwen2_5_vl
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
CONFIG = HERE / "qwen_vl.yaml"
CONVERT = HERE.parent / "scripts" / "convert_dataset.py"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
IMAGE_TOKEN = 5  # <|image_pad|>
SHAPES = {  # tiny stand-ins for Qwen2.5-VL-3B's tower and language model
    "vision": {
        "kind": "vit",
        "patch": 4,
        "channels": 3,
        "width": 32,
        "depth": 2,
        "heads": 2,
        "mlp": 48,
        "out_width": 48,
        "merge": 2,
        "max_grid": 8,  # no position table (rope2d): images up to 32 x 32 pixels
        "block": "rmsnorm_glu",
        "pos_embed": "rope2d",
        "projector": "patch_merger",
        "window": 4,  # patches a side; block 1 attends over whole images
        "full_layers": [1],
        "act": "silu",
    },
    "llm": {
        "kind": "llm",
        "vocab": 320,
        "width": 48,
        "depth": 1,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 12,
        "mlp": 96,
        "qkv_bias": True,
        "tie_embeddings": True,
        "mrope_section": [2, 2, 2],  # temporal, row, column: head_dim / 2 rotated pairs
        "rope_theta": 1000000.0,
    },
}
# Qwen2.5-VL's chat template (the Hub's chat_template.json)
TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 256,  # 16 x 16
    "max_pixels": 1024,  # 32 x 32: the tiny tower's largest
}
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
SIDES = ((16, 16), (16, 32), (32, 24), (24, 16))  # (height, width) pixels: the processor keeps each


def make_folder(folder: Path, texts: list[str]) -> None:
    """The random Qwen2.5-VL folder: weights of `SHAPES` (a config's random initialisation), and
    the tokenizer, chat template and preprocessor files a checkpoint ships."""
    import jax
    from flax import linen as nn
    from maestro_jax.models import hf_encoders
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    shaped = [f"models.{s}={json.dumps(fields)}" for s, fields in SHAPES.items()]
    cfg = mj.load_config(CONFIG, [*shaped, "data.kind=synthetic", f"workload_settings.image_token={IMAGE_TOKEN}"])
    params = jax.device_get(nn.meta.unbox(mj.Trainer(cfg).graph.init(jax.random.key(0))))
    vision, llm = ((params[s]["params"], cfg.models[s].model_dump()) for s in ("vision", "llm"))
    hf_encoders.save_qwen_vl(folder, *vision, *llm, image_token=IMAGE_TOKEN)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def make_data(work: Path, folder: Path) -> Path:
    """Images of different sizes and LLaVA conversations about them under `work/data`, converted
    with the folder's tokenizer and image tokens; returns the ArrayRecord file."""
    data = work / "data"
    (data / "images").mkdir(parents=True, exist_ok=True)
    said = []
    for i in range(16):
        colour, (h, w) = list(COLOURS)[i % 4], SIDES[(i // 4) % 4]
        image = Image.new("RGB", (w, h), (128, 128, 128))
        ImageDraw.Draw(image).rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=COLOURS[colour])
        image.save(data / "images" / f"img{i:02d}.png")
        said.append(f"a {colour} box")
    rng = np.random.default_rng(0)
    records = []
    for i in range(32):
        picks = [int(k) for k in rng.choice(len(said), size=1 + i % 2, replace=False)]
        if len(picks) == 1:
            turns = [("human", "<image>\nwhat is in the picture?"), ("gpt", f"{said[picks[0]]}.")]
        else:
            turns = [("human", "compare <image> and <image>."), ("gpt", f"{said[picks[0]]} and {said[picks[1]]}.")]
        names = [f"img{k:02d}.png" for k in picks]
        records.append({"id": f"s{i}", "image": names, "conversations": [{"from": f, "value": v} for f, v in turns]})
    (data / "llava.json").write_text(json.dumps(records, indent=1))
    make_folder(folder, [t["value"].replace("<image>", "") for r in records for t in r["conversations"]])
    out = data / "train.array_record"
    cmd = [sys.executable, str(CONVERT), str(data / "llava.json"), str(out), "--tokenizer", str(folder)]
    cmd += ["--config", str(CONFIG), "--set", f"models.vision.hf={folder}", "--set", f"models.llm.hf={folder}"]
    subprocess.run([*cmd, "--image-root", str(data / "images"), "--strict"], check=True, stdout=subprocess.DEVNULL)
    return out


def main(work: Path) -> dict:
    """The whole recipe under `work`; returns the metrics and the paths it wrote."""
    work = Path(work).absolute()
    folder = work / "hf/qwen2_5_vl"
    data = make_data(work, folder)
    overrides = [f"output_dir={work / 'run'}", f"data.paths=[{data}]"]
    overrides += [f"models.{s}.hf={folder}" for s in ("vision", "llm")]
    history = mj.Trainer(mj.load_config(CONFIG, overrides)).train(progress=False)
    export = work / "export/qwen2_5_vl"
    args = ["export", "--config", str(CONFIG), *overrides, "--section", "vision,llm", "--out", str(export)]
    if status := cli.main(args):
        raise SystemExit(status)
    print(f"loss {history[0]['train/loss']:.3f} -> {history[-1]['train/loss']:.3f}; VLM exported to {export}")
    checked = None
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        checked = cli.main(["check-hf", "--hf", str(export)])  # 0: transformers gives maestro's tokens and logits
        if checked:
            raise SystemExit(checked)
    return {
        "history": history,
        "hf": folder,
        "data": data,
        "export": export,
        "overrides": overrides,
        "checked": checked,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/qwen_vl"))
    workdir = ap.parse_args().workdir
    if importlib.util.find_spec("tokenizers") is None:  # the recipe trains its tokenizer, and converts chats
        print(
            "error: this example needs the `tokenizers` package; install the convert extra: pip install "
            "'maestro-jax[convert]'",
            file=sys.stderr,
        )
        sys.exit(2)
    main(workdir)
