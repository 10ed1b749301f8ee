"""How checkpoint tensor names map onto the model's parameters where several checkpoint tensors fill one fused
parameter (q/k/v into qkv_proj, gate/up into gate_up_proj), and Mixtral's names in the other families' spelling.
Shared by the loader and the conversion that runs while torch imports (converted.py), so it imports nothing heavy."""

from __future__ import annotations

import re

FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_NAME = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
MIXTRAL_PARTS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def standard_name(name: str) -> str:
    """Mixtral's names as the other families spell them: its sparse MLP is the layer's `mlp` and an expert's w1, w3,
    w2 are gate_proj, up_proj, down_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{MIXTRAL_PARTS[m.group(2)]}.", name)


def fused_part(name: str) -> tuple[str, int] | None:
    """(the fused parameter's name, this part's index in it) for a standard-named part (q/k/v, gate/up); else None."""
    match = FUSED_NAME.match(name)
    if match is None:
        return None
    fused, shard = FUSED[match.group(2)]
    return f"{match.group(1)}.{fused}.{match.group(3)}", shard


def parts_of(fused_param: str) -> int:
    """How many checkpoint parts fill the fused parameter (3 for qkv_proj, 2 for gate_up_proj), 0 for another."""
    module = fused_param.rsplit(".", 2)[-2] if fused_param.count(".") >= 2 else ""
    return len(SHARDS.get(module, ()))
