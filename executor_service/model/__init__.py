"""Llama-family model: config parsing, the packed-batch module, and the safetensors loader."""

from executor_service.model.config import ModelConfig, ModelLoadError, RopeScaling
from executor_service.model.llama import AttentionMetadata, AttentionOps, LlamaForCausalLM
from executor_service.model.loader import load_model

__all__ = [
    "AttentionMetadata",
    "AttentionOps",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "load_model",
]
