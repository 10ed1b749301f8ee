"""Load a Hugging Face Llama-family checkpoint (safetensors, single or sharded) into LlamaForCausalLM.

Under tensor parallelism each rank reads only its slice of each tensor (safetensors get_slice): whole
query/KV heads and an intermediate slice of the column-parallel projections, the matching input columns of
the row-parallel ones, and its vocabulary rows of the embedding and LM head (padding rows zeroed).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from executor_service.checkpoint_names import SHARDS, fused_part, parts_of, standard_name
from executor_service.converted import ConvertedFile, ConvertedWeights, read_header
from executor_service.model.config import ModelConfig, ModelLoadError
from executor_service.model.families import QKNorm
from executor_service.model.llama import LlamaForCausalLM, ModelOps
from executor_service.model.parallel import SINGLE, Linear, ParallelContext, ShardLayout
from executor_service.startup import Phases

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
FileHook = Callable[[LlamaForCausalLM, set[str]], None]
ALIAS_ALIGNMENT = 64
MADV_POPULATE_READ = 22  # linux/mman.h; Python's mmap module does not name it
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True, frozen=True)
class Split:
    """This rank's part of a checkpoint tensor: [start, stop) of dimension dim, whose full size is total."""

    dim: int
    start: int
    stop: int
    total: int


@dataclass(slots=True, frozen=True)
class Target:
    """Where a checkpoint tensor goes: `param`, and which `shard` of its fused output rows (q/k/v, gate/up);
    `unfuse`: the checkpoint tensor is itself fused (Phi-3) and split over ranks part by part."""

    param: str
    shard: int | None
    split: Split | None = None
    padded: bool = False
    unfuse: bool = False


def load_model(model_dir: Path | str, *, device: torch.device, dtype: torch.dtype,
               ops: ModelOps, parallel: ParallelContext = SINGLE, phases: Phases | None = None,
               on_file: FileHook | None = None, converted: ConvertedWeights | None = None) -> LlamaForCausalLM:
    """Build the model (this rank's shard of it) on `device` in `dtype` and fill every parameter; `phases` gets
    the seconds of "read" (copying the weights out of the files into the parameters; "read+convert" where the
    checkpoint's dtype differs, converted on the way in the same pass). `on_file(model, names)` is called after
    each file with the names of the parameters filled whole so far (the packing starts on them meanwhile).
    `converted`: the files' bfloat16 tensors already widened to float32 (converted.py), taken where they fit."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    cfg = ModelConfig.from_dir(directory)
    files = find_weight_files(directory)
    phases = phases or Phases()
    with phases.phase("allocate"):
        model = LlamaForCausalLM(cfg, ops, device=device, dtype=dtype, parallel=parallel)
    converts = DTYPE_NAMES.get(cfg.dtype, dtype) != dtype
    with phases.phase(f"read+convert {cfg.dtype}->{str(dtype).removeprefix('torch.')}" if converts else "read"):
        load_weights(model, files, on_file, converted if device.type == "cpu" and dtype == torch.float32 else None)
    return model.eval()


def find_weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        return files_from_index(index)
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    hint = " (only safetensors checkpoints are supported)" if any(directory.glob("*.bin")) else ""
    raise ModelLoadError(f"model directory {directory}: missing file {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


def files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index}: cannot read weight_map: {exc}") from exc
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"{index}: missing weights file {path.name}")
    return files


def load_weights(model: LlamaForCausalLM, files: list[Path], on_file: FileHook | None = None,
                 converted: ConvertedWeights | None = None) -> None:
    """Fill every parameter from the checkpoint: on the CPU a whole tensor already in the parameter's dtype becomes
    the parameter itself, a view of the file's private memory map (no copy; pages come from the page cache as they
    are touched, shared with other processes that map the file) or of its float32 conversion made while torch
    imported (`converted`, where a fused parameter's parts lie one after another there: the whole parameter);
    others are copied straight out of the map (one copy, converted to the parameter's dtype on the way: the fused
    qkv/gate_up parts, other dtypes, CUDA), through safetensors' reader where the map cannot serve (slices under
    tensor parallelism, an odd file)."""
    params = dict(model.named_parameters())
    slices = shard_slices(model)
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}
    loaded: set[tuple[str, int | None]] = set()
    for path in files:
        try:
            one_rank = model.layout.world_size == 1
            widened = ConvertedViews.of(converted.take(path)) if converted is not None and one_rank else None
            source = FileTensors(path, widened) if one_rank else None
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118
                    target = map_name(name, params, model.config, model.layout)
                    if target is not None:
                        view = source.tensor(name) if source is not None and target.split is None else None
                        if widened is not None and target.shard is not None:
                            alias_span(params[target.param], target.param, widened, slices)
                        fill(params[target.param], target, view, reader, name, model, slices,
                             target.param in linear_weights)
                        loaded.add((target.param, target.shard))
            del source, widened
        except ModelLoadError:
            raise
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            raise ModelLoadError(f"{path}: cannot read weights: {exc}") from exc
        if on_file is not None:
            on_file(model, filled_params(loaded))
    check_complete(params, loaded, files[0].parent)


def fill(param: torch.nn.Parameter, target: Target, view: Tensor | None, reader: Any, name: str,
         model: LlamaForCausalLM, slices: dict[str, list[tuple[int, int]]], linear: bool) -> None:
    """Fill (this part of) the parameter from checkpoint tensor `name`: `view` itself where it can be the parameter,
    else a copy of `view` or of what safetensors' reader reads."""
    if target.unfuse:
        copy_fused_parts(param, reader.get_tensor(name), name, model)
    elif view is not None and can_alias(param, target, view, linear):
        param.data = view  # no copy: the parameter is the file's pages (or the conversion's)
    else:
        copy_weight(param, target, slices, view if view is not None else read_tensor(reader, name, target), name)


class FileTensors:
    """A checkpoint file's whole tensors on one rank: the float32 conversion made while torch imported where there
    is one, else views of the file's memory map (MappedSafetensors, opened at the first tensor it must serve)."""

    def __init__(self, path: Path, widened: ConvertedViews | None) -> None:
        self.path, self.widened = path, widened
        self.mapped: MappedSafetensors | None = None
        self.opened = False

    def tensor(self, name: str) -> Tensor | None:
        view = self.widened.tensor(name) if self.widened is not None else None
        if view is None and not self.opened:
            self.mapped, self.opened = MappedSafetensors.open(self.path), True
        return view if view is not None or self.mapped is None else self.mapped.tensor(name)


def filled_params(loaded: set[tuple[str, int | None]]) -> set[str]:
    """The parameters filled whole: loaded at once, or every part of a fused one (q, k, v; gate, up)."""
    parts: dict[str, set[int | None]] = {}
    for param, shard in loaded:
        parts.setdefault(param, set()).add(shard)
    fused = {param: parts_of(param) for param in parts}
    return {param for param, shards in parts.items() if None in shards or len(shards) == fused[param]}


class MappedSafetensors:
    """A safetensors file mapped into memory (private, copy-on-write: read lazily from the page cache, never
    written back), whose tensors are zero-copy views of the map. tensor() is None where a tensor's offset does
    not suit a view of its dtype (the caller reads it through safetensors then)."""

    def __init__(self, buffer: mmap.mmap, header: dict[str, Any], data_start: int) -> None:
        self.buffer = buffer
        self.header = header
        self.data_start = data_start

    @classmethod
    def open(cls, path: Path) -> MappedSafetensors | None:
        with open(path, "rb") as f:
            found = read_header(f, os.fstat(f.fileno()).st_size)
            if found is None:
                return None
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        populate(buffer)
        return cls(buffer, *found)

    def tensor(self, name: str) -> Tensor | None:
        entry = self.header.get(name)
        if not isinstance(entry, dict):
            return None
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype", ""))
        if dtype is None:
            return None
        try:
            begin, end = (self.data_start + int(x) for x in entry["data_offsets"])
            shape = [int(d) for d in entry["shape"]]
        except (KeyError, TypeError, ValueError):
            return None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin % itemsize or end > len(self.buffer) or end - begin != math.prod(shape) * itemsize:
            return None
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffer is writable (copy-on-write); torch warns on some versions
            flat = torch.frombuffer(self.buffer, dtype=torch.uint8, count=end - begin, offset=begin)
        return flat.view(dtype).view(shape)


def populate(buffer: mmap.mmap) -> None:
    """Map the whole file in one call (Linux 5.14+ MADV_POPULATE_READ: read faults only, so the private map's pages
    stay the page cache's, shared, not copied): a cold file is read sequentially at the disk's speed, a warm one
    costs no page fault per 4 KiB on the copies. Elsewhere the kernel is only told the map will be needed."""
    try:
        buffer.madvise(MADV_POPULATE_READ)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            buffer.madvise(mmap.MADV_WILLNEED)


def can_alias(param: torch.nn.Parameter, target: Target, view: Tensor, linear: bool) -> bool:
    """Whether the parameter can be the file's mapped tensor itself: a whole CPU tensor of the parameter's dtype
    and shape, and, for a linear layer's weight, 64-byte aligned as the kernels' loads like best."""
    return (param.device.type == "cpu" and target.shard is None and not target.padded
            and view.dtype == param.dtype and tuple(view.shape) == tuple(param.shape)
            and (not linear or view.data_ptr() % ALIAS_ALIGNMENT == 0))


def map_name(name: str, params: dict[str, torch.nn.Parameter], cfg: ModelConfig,
             layout: ShardLayout) -> Target | None:
    if name.endswith(IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
        return None
    name = standard_name(name)
    split = checkpoint_split(name, cfg, layout)
    fused = fused_part(name)
    if fused is not None:
        param, shard = fused
        return Target(param, shard, split) if param in params else None
    padded = split is not None and name in ("model.embed_tokens.weight", "lm_head.weight")
    unfuse = layout.world_size > 1 and name.rsplit(".", 2)[-2] in SHARDS
    return Target(name, None, split, padded, unfuse) if name in params else None


def copy_fused_parts(param: torch.nn.Parameter, tensor: Tensor, name: str, model: LlamaForCausalLM) -> None:
    """A fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) into this rank's fused parameter: each part's
    rows (q, k, v; gate, up) cut as the unfused part would be."""
    head, fused, kind = name.rsplit(".", 2)
    dest, offset, out = param.data, 0, 0
    for part in SHARDS[fused]:
        split = checkpoint_split(f"{head}.{part}.{kind}", model.config, model.layout)
        if split is None:
            raise ModelLoadError(f"weight {name}: cannot split its {part} part over ranks")
        rows = split.stop - split.start
        if offset + split.total > tensor.shape[0] or out + rows > dest.shape[0]:
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, too few rows for the config")
        dest[out : out + rows].copy_(tensor[offset + split.start : offset + split.stop])
        offset, out = offset + split.total, out + rows
    if offset != tensor.shape[0] or out != dest.shape[0]:
        raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies another")


def checkpoint_split(name: str, cfg: ModelConfig, layout: ShardLayout) -> Split | None:
    """Which part of checkpoint tensor `name` this rank holds; None for the whole tensor."""
    if layout.world_size == 1:
        return None
    _, module, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", *name.split(".", 1))
    d, rank = layout.head_dim, layout.rank
    q = layout.num_heads * d
    full_inter = intermediate_of(name, cfg)
    inter = full_inter // layout.world_size
    match module:
        case "q_proj":
            return Split(0, rank * q, (rank + 1) * q, cfg.num_heads * d)
        case "q_norm" if cfg.features.qk_norm == QKNorm.WHOLE:
            return Split(0, rank * q, (rank + 1) * q, cfg.num_heads * d)
        case "k_norm" if cfg.features.qk_norm == QKNorm.WHOLE:
            start = layout.kv_head_start * d
            return Split(0, start, start + layout.num_kv_heads * d, cfg.num_kv_heads * d)
        case "self_attn" if kind == "sinks":
            return Split(0, rank * layout.num_heads, (rank + 1) * layout.num_heads, cfg.num_heads)
        case "experts" if kind in ("gate_up_proj", "gate_up_proj_bias", "down_proj"):  # GPT-OSS's stacked experts
            return oai_expert_split(kind, layout.rank, inter, full_inter)
        case "k_proj" | "v_proj":
            start = layout.kv_head_start * d
            return Split(0, start, start + layout.num_kv_heads * d, cfg.num_kv_heads * d)
        case "gate_proj" | "up_proj":
            return Split(0, rank * inter, (rank + 1) * inter, full_inter)
        case "o_proj" if kind == "weight":
            return Split(1, rank * q, (rank + 1) * q, cfg.num_heads * d)
        case "down_proj" if kind == "weight":
            return Split(1, rank * inter, (rank + 1) * inter, full_inter)
        case "embed_tokens" | "lm_head":
            return Split(0, layout.vocab_start, layout.vocab_start + layout.vocab_rows, cfg.vocab_size)
    return None


def oai_expert_split(kind: str, rank: int, inter: int, full_inter: int) -> Split:
    """GPT-OSS's experts: gate_up_proj [E, hidden, 2I] (gate and up interleaved, so a rank's intermediate rows are
    contiguous columns) and its bias [E, 2I]; down_proj [E, I, hidden]."""
    if kind == "down_proj":
        return Split(1, rank * inter, (rank + 1) * inter, full_inter)
    dim = 2 if kind == "gate_up_proj" else 1
    return Split(dim, 2 * rank * inter, 2 * (rank + 1) * inter, 2 * full_inter)


def intermediate_of(name: str, cfg: ModelConfig) -> int:
    """The full intermediate size of the MLP that checkpoint tensor `name` belongs to: an expert's, the shared
    expert's, or the dense MLP's."""
    moe = cfg.features.moe
    if moe is not None and ".experts." in name:
        return moe.intermediate_size
    if moe is not None and ".shared_expert." in name:
        return moe.shared_intermediate_size
    return cfg.intermediate_size


def read_tensor(reader: Any, name: str, target: Target) -> Tensor:
    split = target.split
    if split is None:
        return reader.get_tensor(name)
    view = reader.get_slice(name)
    shape = tuple(view.get_shape())
    if len(shape) <= split.dim or shape[split.dim] != split.total:
        implied = list(shape)
        if len(shape) > split.dim:
            implied[split.dim] = split.total
        raise ModelLoadError(f"weight {name} has shape {shape}, the config implies {tuple(implied)}")
    return view[(slice(None),) * split.dim + (slice(split.start, split.stop),)]


def shard_slices(model: LlamaForCausalLM) -> dict[str, list[tuple[int, int]]]:
    """The rows of q, k and v in this rank's fused qkv_proj (a fused gate_up_proj is two halves)."""
    layout = model.layout
    q = layout.num_heads * layout.head_dim
    kv = layout.num_kv_heads * layout.head_dim
    return {"qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]}


def copy_weight(param: torch.nn.Parameter, target: Target, slices: dict[str, list[tuple[int, int]]],
                tensor: Tensor, name: str) -> None:
    dest = param.data
    if target.shard is not None:
        lo, hi = part_rows(target.param, target.shard, dest.shape[0], slices)
        dest = dest[lo:hi]
    if target.padded and dest.shape[0] > tensor.shape[0]:
        dest[tensor.shape[0] :].zero_()
        dest = dest[: tensor.shape[0]]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}"
        )
    if not is_same_memory(dest, tensor):  # a part of a fused parameter that is its converted span already
        dest.copy_(tensor)


def part_rows(param: str, shard: int, rows: int, slices: dict[str, list[tuple[int, int]]]) -> tuple[int, int]:
    """The rows [lo, hi) of part `shard` in fused parameter `param` of `rows` rows: q, k, v as `slices` say, gate
    and up its halves."""
    fused = param.rsplit(".", 2)[-2]
    half = rows // 2
    return slices[fused][shard] if fused in slices else (shard * half, (shard + 1) * half)


def is_same_memory(a: Tensor, b: Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.device == b.device
            and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride())


class ConvertedViews:
    """A file's float32 conversion (converted.py) as tensors: views of its arena, which they keep alive."""

    def __init__(self, converted: ConvertedFile) -> None:
        self.converted = converted

    @classmethod
    def of(cls, converted: ConvertedFile | None) -> ConvertedViews | None:
        return None if converted is None else cls(converted)

    def tensor(self, name: str) -> Tensor | None:
        placed = self.converted.tensors.get(name)
        return None if placed is None else self.view(placed.offset, placed.shape)

    def span(self, param: str) -> tuple[Tensor, tuple[int, ...]] | None:
        """The fused parameter's parts converted one after another (a float32 tensor) and each part's rows."""
        span = self.converted.spans.get(param)
        return None if span is None else (self.view(span.offset, span.shape), span.rows)

    def view(self, offset: int, shape: tuple[int, ...]) -> Tensor:
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=torch.float32)
        return torch.frombuffer(self.converted.arena, dtype=torch.float32, count=count, offset=offset).view(shape)


def alias_span(param: torch.nn.Parameter, name: str, widened: ConvertedViews,
               slices: dict[str, list[tuple[int, int]]]) -> None:
    """Make fused parameter `name` its converted span (no copy; its parts' copies then find themselves in place)
    where the span has the parameter's shape and its parts lie in the rows the loader puts them in."""
    found = widened.span(name)
    if found is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return
    span, rows = found
    if span.data_ptr() == param.data.data_ptr() or tuple(span.shape) != tuple(param.shape) \
            or span.data_ptr() % ALIAS_ALIGNMENT:
        return
    starts = [sum(rows[:i]) for i in range(len(rows))]
    if all(part_rows(name, i, span.shape[0], slices) == (starts[i], starts[i] + rows[i]) for i in range(len(rows))):
        param.data = span


def check_complete(params: dict[str, torch.nn.Parameter], loaded: set[tuple[str, int | None]],
                   directory: Path) -> None:
    missing: list[str] = []
    for param in params:
        head, fused, kind = param.rsplit(".", 2) if param.count(".") >= 2 else ("", "", param)
        if fused in SHARDS and (param, None) not in loaded:  # a fused checkpoint tensor (Phi-3) fills it whole
            parts = enumerate(SHARDS[fused])
            missing += [f"{head}.{part}.{kind}" for i, part in parts if (param, i) not in loaded]
        elif fused not in SHARDS and (param, None) not in loaded:
            missing.append(param)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"model directory {directory}: missing weight {', '.join(missing[:5])}{more}")
