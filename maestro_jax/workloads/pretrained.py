"""Starting sections from Hugging Face folders (`sections.<s>.init.hf_path`), for the LLM-backed
sections of the built-in workloads and their vision (SigLIP, CLIP, a Gemma 3 VLM's, Qwen2.5-VL's and
Qwen3-VL's) and audio (Whisper) towers; the model named like the section describes the checkpoint.

The weight mappings are `models.hf` (decoders) and `models.hf_encoders` (towers), beside the
models they convert. A loader is called by the runtime
as `loader(section, path, states, programs)` and returns the new `states`: it replaces fields of
the sections' states (`params`, `consts`, `opt_state`) and starts an optimizer through
`programs[section].init_optimizer`, so it needs nothing from the runtime's modules."""

from __future__ import annotations

import dataclasses

from maestro_jax.config import Config, ConfigError


def check_pretrained(cfg: Config, pretrained) -> None:
    """Each `init.hf_path` has a loader, a readable config.json that matches `models.<s>` field by
    field, and readable safetensors files (before compiling)."""
    from maestro_jax.models import hf, hf_encoders

    fields_of = {"llm": hf.llm_fields, "vit": hf_encoders.vit_fields, "audio": hf_encoders.audio_fields}
    for s, sc in cfg.sections.items():
        if sc.init is None or sc.init.hf_path is None:  # random, or another run's checkpoint (training)
            continue
        if s not in pretrained:
            raise ConfigError(
                f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: section {s!r} has no Hugging "
                f"Face importer; supported: {sorted(pretrained)}"
            )
        # a plug-in's own model kind: no fields to compare here (its loader reads the folder)
        read_fields = fields_of.get(cfg.models[s].kind, lambda path: {})
        try:
            fields = read_fields(sc.init.hf_path)
            hf.weight_files(sc.init.hf_path)  # present and readable, before anything compiles
        except KeyError as err:
            raise ConfigError(
                f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: {sc.init.hf_path}/config.json "
                f"has no {err} field"
            ) from None
        except hf.HFError as err:
            raise ConfigError(f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: {err}") from None
        mine = cfg.models[s].model_dump()
        for k, v in fields.items():
            if mine.get(k) != v:
                raise ConfigError(
                    f"error: models.{s}.{k}={mine.get(k)!r}: the checkpoint {sc.init.hf_path} has "
                    f"{k}={v!r}; set models.{s} to the checkpoint's shape ({fields})"
                )
        if cfg.models[s].kind not in fields_of:  # a plug-in's own model kind: its loader reads the folder
            continue
        try:  # every tensor the loader reads is in the safetensors headers
            hf.require_tensors(
                sc.init.hf_path, hf_encoders.tensors_read(cfg.models[s].kind, sc.init.hf_path, fields, mine)
            )
        except hf.HFError as err:
            raise ConfigError(f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: {err}") from None


def load_llm_section(section: str, path: str, states: dict, programs) -> dict:
    """A trained LLM section (VLM llm, KD student) takes the whole model; its optimizer restarts."""
    from maestro_jax.models import hf

    return _with_params(section, states, programs, hf.load_llm(path, states[section].params, hf.llm_fields(path)))


def load_teacher_section(section: str, path: str, states: dict, programs, head_in: str = "student") -> dict:
    """A KD teacher: its body in its own section, its output layer (`<section>_head`, as
    `workloads.kd.Teacher.head` names it) in the student section."""
    from maestro_jax.models import hf

    fields = hf.llm_fields(path)
    st, student, key = states[section], states[head_in], f"{section}_head"
    body = hf.load_llm(path, st.consts["llm"], fields, with_head=False)
    head = hf.output_layer(path, fields, student.consts[key])
    return {
        **states,
        section: dataclasses.replace(st, consts={**st.consts, "llm": body}),
        head_in: dataclasses.replace(student, consts={**student.consts, key: head}),
    }


def load_vision_section(section: str, path: str, states: dict, programs) -> dict:
    """A vision section takes a SigLIP, CLIP, Gemma 3 or Qwen-VL tower (the blocks up to its
    `feature_layer`); its merger keeps its initial values unless the folder holds it (a Gemma 3
    VLM's projector, a Qwen-VL merger), its optimizer restarts."""
    from maestro_jax.models import hf_encoders

    params = hf_encoders.load_vit(path, states[section].params, hf_encoders.vit_fields(path))
    return _with_params(section, states, programs, params)


def load_audio_section(section: str, path: str, states: dict, programs) -> dict:
    """An audio section takes a Whisper encoder; its `out_proj` keeps its initial values, its optimizer restarts."""
    from maestro_jax.models import hf_encoders

    params = hf_encoders.load_audio(path, states[section].params, hf_encoders.audio_fields(path))
    return _with_params(section, states, programs, params)


def _with_params(section: str, states: dict, programs, params) -> dict:
    st = states[section]
    return {
        **states,
        section: dataclasses.replace(st, params=params, opt_state=programs[section].init_optimizer(params)),
    }
