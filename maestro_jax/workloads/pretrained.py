"""Starting sections from Hugging Face folders (`sections.<s>.init.hf_path`), for the LLM-backed
sections of the built-in workloads; the model named like the section describes the checkpoint.

The weight mapping is `models.hf`, beside the model it converts. A loader is called by the runtime
as `loader(section, path, states, programs)` and returns the new `states`: it replaces fields of
the sections' states (`params`, `consts`, `opt_state`) and starts an optimizer through
`programs[section].init_optimizer`, so it needs nothing from the runtime's modules."""

from __future__ import annotations

import dataclasses

from maestro_jax.config import Config, ConfigError


def check_pretrained(cfg: Config, pretrained) -> None:
    """Each `init.hf_path` has a loader, a readable config.json that matches `models.<s>` field by
    field, and readable safetensors files (before compiling)."""
    from models import hf

    for s, sc in cfg.sections.items():
        if sc.init is None:
            continue
        if s not in pretrained:
            raise ConfigError(
                f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: section {s!r} has no Hugging "
                f"Face importer; supported: {sorted(pretrained)}"
            )
        try:
            fields = hf.llm_fields(sc.init.hf_path)
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


def load_llm_section(section: str, path: str, states: dict, programs) -> dict:
    """A trained LLM section (VLM llm, KD student) takes the whole model; its optimizer restarts."""
    from models import hf

    st = states[section]
    params = hf.load_llm(path, st.params, hf.llm_fields(path))
    return {
        **states,
        section: dataclasses.replace(st, params=params, opt_state=programs[section].init_optimizer(params)),
    }


def load_teacher_section(section: str, path: str, states: dict, programs, head_in: str = "student") -> dict:
    """A KD teacher: its body in the teacher section, its output layer in the student section."""
    from models import hf

    fields = hf.llm_fields(path)
    st, student = states[section], states[head_in]
    body = hf.load_llm(path, st.consts["llm"], fields, with_head=False)
    head = hf.output_layer(path, fields, student.consts["teacher_head"])
    return {
        **states,
        section: dataclasses.replace(st, consts={**st.consts, "llm": body}),
        head_in: dataclasses.replace(student, consts={**student.consts, "teacher_head": head}),
    }
