"""KV cache groups of a hybrid model (sliding-window layers beside full-attention ones), vLLM V1's design in our
own shape: the layers are cut into groups of equal size, one of the full-attention layers and ceil(window layers
/ that size) of window layers (the last one padded), and a block of the one device pool is a page holding one
group's layers: so a block id belongs to one group at a time, swaps and copies stay block-id mappings, and the
scheduler sizes every group out of one pool. The full-attention group reads the request's block table, window
group g its own table (NewRequest.window_block_ids): a ring of ceil(window / block_size) + 1 blocks that the
request's positions reuse (Capabilities.kv_window_ring; block i in ring[i % R]), so it holds the window's blocks
only, prefill chunks included.

A model whose every layer slides (Mistral, Phi-3, Mixtral with a window) is one window group of every layer with no
layer reading the block table (`window_only`, Capabilities.kv_window_only): a request holds its ring only, R blocks
whatever its length. A model with no window layer, or the release turned off, is one group of every layer, as
before.

Each layer keeps its page slot (the position of its layer in its group) and its group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KVLayout:
    page_layers: int  # layers whose KV one block holds
    layer_slots: tuple[int, ...]  # per model layer: its slot in a page
    layer_groups: tuple[int, ...]  # per model layer: 0 = the block table, g + 1 = window group g's table
    num_window_groups: int = 0
    window: int = 0  # the most keys a window layer's query reads
    window_only: bool = False  # every layer in window group 0: no layer reads the block table

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        return cls(num_layers, tuple(range(num_layers)), (0,) * num_layers)


def plan_layout(layer_windows: Sequence[int | None], release: bool) -> KVLayout:
    """The groups of a model's layers (a window of None: full attention)."""
    full = [i for i, w in enumerate(layer_windows) if w is None]
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    if not release or not windowed:
        return KVLayout.single(len(layer_windows))
    window = max(w for w in layer_windows if w is not None)
    if not full:  # every layer slides: one window group of them all
        return KVLayout(len(windowed), tuple(range(len(windowed))), (1,) * len(windowed), 1, window, True)
    page = len(full)
    slots = [0] * len(layer_windows)
    groups = [0] * len(layer_windows)
    for j, layer in enumerate(full):
        slots[layer] = j
    for t, layer in enumerate(windowed):
        slots[layer], groups[layer] = t % page, 1 + t // page
    return KVLayout(page, tuple(slots), tuple(groups), -(-len(windowed) // page), window)
