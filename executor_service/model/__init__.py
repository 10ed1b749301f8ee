"""Llama-family model: config parsing, the packed-batch module, and the safetensors loader."""

from executor_service.model.config import ModelConfig, ModelLoadError, RopeScaling
from executor_service.model.llama import AttentionMetadata, LlamaForCausalLM, ModelOps
from executor_service.model.loader import load_model
from executor_service.model.parallel import SINGLE, ParallelContext, ShardLayout

__all__ = [
    "SINGLE",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelLoadError",
    "ModelOps",
    "ParallelContext",
    "RopeScaling",
    "ShardLayout",
    "load_model",
]
