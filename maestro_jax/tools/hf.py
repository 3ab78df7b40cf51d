"""Hugging Face export for the CLI (`maestro-jax export`): a trained LLM section written as a folder
that `transformers` loads.

The weight mapping itself (import and export, Llama and Qwen2/Qwen3/Qwen3-MoE) lives beside the
model it converts, in `models/hf.py`; the workloads' `init.hf_path` loaders import it from there.
This module keeps the names the CLI's `export` calls.
"""

from __future__ import annotations

from maestro_jax.models.hf import HFError, save_llm

__all__ = ["HFError", "save_llm"]
