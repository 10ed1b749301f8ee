"""A bfloat16 checkpoint widened to float32 on the prefetch thread while torch imports (#33): every bfloat16 value
widens bit-equal to torch's `.to(torch.float32)`; the loader makes the parameters views of the conversion (a fused
q/k/v or gate/up parameter whole where its file holds all its parts) and they equal a load without it; a file that
cannot be converted is left to the loader; a real executor process serving a sharded bfloat16 checkpoint converts
it while importing and gives transformers' greedy tokens, and so does its restart, which maps the float32 form the
first start kept in the start-up cache (test_converted_cache.py)."""

from __future__ import annotations

import json
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from executor_service import prefetch
from executor_service.config import ExecutorConfig
from executor_service.converted import (
    ConvertedFile,
    ConvertedWeights,
    Entry,
    convert_file,
    key_of,
    plan_arena,
    read_header,
)
from executor_service.default_model.model import make_model
from executor_service.model import LlamaForCausalLM, load_model
from executor_service.runner.torch_backend import model_ops
from tests.executor.test_model_families import greedy_over_grpc
from tests.executor.test_torch_model import assert_same_tokens, hf_greedy, make_prompt
from tests.support.procs import loopback, start_listening, stop, wait_healthy

CPU = torch.device("cpu")


def converted_of(path: Path) -> ConvertedFile | None:
    with open(path, "rb") as f:
        header = read_header(f, path.stat().st_size)
        assert header is not None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as buffer:
            return convert_file(buffer, *header)


def arena_view(converted: ConvertedFile, name: str) -> np.ndarray:
    placed = converted.tensors[name]
    count = int(np.prod(placed.shape))
    return np.frombuffer(converted.arena, dtype=np.uint32, count=count, offset=placed.offset)


def test_every_bfloat16_value_widens_bit_equal_to_torch(tmp_path: Path) -> None:
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # NaNs, ±0, ±inf
    path = tmp_path / "all.safetensors"
    save_file({"w": patterns.reshape(256, 256), "f32": torch.ones(3), "odd": patterns[:7].clone()}, str(path))
    converted = converted_of(path)
    assert converted is not None and set(converted.tensors) == {"w", "odd"}  # float32 is left to the map
    expected = patterns.to(torch.float32).view(torch.int32).numpy().view(np.uint32)
    assert np.array_equal(arena_view(converted, "w"), expected)
    assert np.array_equal(arena_view(converted, "odd"), expected[:7])
    assert all(p.offset % 64 == 0 for p in converted.tensors.values())


def entry(name: str, rows: int, cols: int = 8) -> Entry:
    return Entry(name, "BF16", (rows, cols), 0, rows * cols * 2)


def test_a_fused_parameter_is_placed_whole_only_where_the_file_holds_all_its_parts() -> None:
    entries = [entry("model.layers.0.self_attn.k_proj.weight", 2), entry("model.layers.0.self_attn.q_proj.weight", 8),
               entry("model.layers.0.self_attn.v_proj.weight", 2), entry("model.layers.0.mlp.gate_proj.weight", 16),
               entry("model.layers.0.mlp.down_proj.weight", 8, 16)]  # up_proj is in another file
    placed, spans, size = plan_arena(entries)
    qkv = spans["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (12, 8) and qkv.rows == (8, 2, 2)
    q, k, v = (placed[f"model.layers.0.self_attn.{p}_proj.weight"].offset for p in "qkv")
    assert (q, k, v) == (qkv.offset, qkv.offset + 8 * 8 * 4, qkv.offset + 10 * 8 * 4)  # q, k, v in part order
    assert set(spans) == {"model.layers.0.self_attn.qkv_proj.weight"}
    assert size % 64 == 0 and size >= sum(4 * e.shape[0] * e.shape[1] for e in entries)


def load(model_dir: Path, converted: ConvertedWeights | None) -> LlamaForCausalLM:
    return load_model(model_dir, device=CPU, dtype=torch.float32, ops=model_ops(CPU, torch.float32),
                      converted=converted)


def to_bfloat16(model_dir: Path, shards: list[list[str]] | None = None) -> Path:
    """Rewrite make_model's checkpoint in bfloat16, in the given shards of tensor names (an index) or one file."""
    path = model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as reader:
        tensors = {name: reader.get_tensor(name).to(torch.bfloat16) for name in reader.keys()}  # noqa: SIM118
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    if shards is None:
        save_file(tensors, str(path))
        return model_dir
    path.unlink()
    rest = [n for n in tensors if not any(n in shard for shard in shards)]
    weight_map: dict[str, str] = {}
    for i, names in enumerate([*shards, rest]):
        file = f"model-{i + 1:05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(model_dir / file))
        weight_map |= dict.fromkeys(names, file)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model_dir


def converted_while_reading(model_dir: Path) -> tuple[ConvertedWeights, list[tuple[int, int]]]:
    """The prefetch thread's conversion of model_dir and the address ranges of its arenas."""
    converted = ConvertedWeights()
    thread = prefetch.prefetch_weights(str(model_dir), converted)
    assert thread is not None
    thread.join(timeout=60)
    ranges = []
    for future in converted._files.values():
        result = future.result()
        if result is not None:
            base = np.frombuffer(result.arena, dtype=np.uint8).ctypes.data
            ranges.append((base, base + len(result.arena)))
    return converted, ranges


@pytest.mark.parametrize("split", [False, True])
def test_the_loader_makes_the_parameters_views_of_the_conversion(tmp_path: Path, split: bool) -> None:
    """One file, or q_proj and gate_proj apart from their other parts (those fused parameters are then copied)."""
    apart = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
    model_dir = to_bfloat16(make_model(tmp_path / "m", hidden_size=64, num_layers=2, vocab_size=512),
                            [apart] if split else None)
    converted, arenas = converted_while_reading(model_dir)
    ours = dict(load(model_dir, converted).named_parameters())
    reference = dict(load(model_dir, None).named_parameters())
    copied = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} if split else set()
    for name, param in ours.items():
        assert param.dtype == torch.float32 and torch.equal(param, reference[name]), name
        in_arena = any(lo <= param.data_ptr() < hi for lo, hi in arenas)
        assert in_arena == (name not in copied), name
    assert not converted._files  # each file's conversion was taken: its arena lives only through the parameters


def test_a_file_that_cannot_be_converted_is_left_to_the_loader(tmp_path: Path) -> None:
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    (tmp_path / "f32.safetensors").write_bytes((tmp_path / "bad.safetensors").read_bytes())
    save_file({"w": torch.ones(4)}, str(tmp_path / "f32.safetensors"))
    converted = ConvertedWeights()
    thread = prefetch.prefetch_weights(str(tmp_path), converted)
    assert thread is not None
    thread.join(timeout=60)
    assert converted.take(tmp_path / "bad.safetensors") is None
    assert converted.take(tmp_path / "f32.safetensors") is None  # nothing in bfloat16
    assert converted.take(tmp_path / "never-expected.safetensors") is None
    waiting = ConvertedWeights()
    waiting.expect([tmp_path / "x.safetensors"])
    waiting.abandon()  # what the prefetch thread does on its way out, whatever happened
    assert waiting.take(tmp_path / "x.safetensors") is None


def test_only_a_float32_cpu_executor_in_one_process_converts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(prefetch, "NVIDIA_DRIVER", tmp_path / "no-driver")
    assert prefetch.conversion_for(ExecutorConfig(model="m")) is not None
    assert prefetch.conversion_for(ExecutorConfig(model="m", device="cpu", dtype="float32")) is not None
    assert prefetch.conversion_for(ExecutorConfig(model="m", dtype="bfloat16")) is None
    assert prefetch.conversion_for(ExecutorConfig(model="m", device="cuda")) is None
    assert prefetch.conversion_for(ExecutorConfig(model="m", tensor_parallel_size=2)) is None
    assert prefetch.conversion_for(ExecutorConfig(simulated=True)) is None
    monkeypatch.setattr(prefetch, "NVIDIA_DRIVER", tmp_path)  # a CUDA machine: auto means the GPU, in bfloat16
    assert prefetch.conversion_for(ExecutorConfig(model="m")) is None


async def test_an_executor_serving_a_sharded_bfloat16_checkpoint_gives_transformers_tokens(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = transformers.Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, initializer_range=0.2,
                                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    prompt = make_prompt(20, seed=3, vocab=384)
    reference = None
    for start_number in (1, 2):  # the second start maps the float32 form the first wrote to the start-up cache
        log = tmp_path / f"executor-{start_number}.log"
        proc, ports = start_listening("executor_service", [
            "--model", str(tmp_path / "m"), "--device", "cpu", "--block-size", "8", "--num-gpu-blocks", "32",
            "--num-cpu-blocks", "4", "--startup-cache-dir", str(tmp_path / "cache")], log)
        address = loopback(ports["listen"])
        try:
            wait_healthy(address, proc)
            info, tokens = await greedy_over_grpc(address, prompt)
        finally:
            assert stop(proc) == 0, log.read_text()[-3000:]
        files = len(list((tmp_path / "m").glob("*.safetensors")))
        mapped = 0 if start_number == 1 else files
        assert "converting them to float32" in log.read_text() and info.dtype == "float32"
        assert f"({mapped} of {files} mapped from the cache)" in log.read_text()
        reference = reference or hf_greedy(hf.float().eval(), prompt, len(tokens))
        assert_same_tokens(tokens, reference, (2,))
    assert len(list((tmp_path / "cache" / "converted").glob("*.f32"))) == files


def test_the_loader_waits_for_a_file_still_being_converted(tmp_path: Path) -> None:
    """take() called before put() (the loader ahead of the prefetch thread on a cold start) gets the file."""
    path = tmp_path / "w.safetensors"
    converted = ConvertedWeights()
    converted.expect([path])
    got: list[ConvertedFile | None] = []
    taker = threading.Thread(target=lambda: got.append(converted.take(path)), daemon=True)
    taker.start()
    future = converted._files[key_of(path)]
    while taker.is_alive() and not future._condition._waiters:  # type: ignore[attr-defined]  # take() waits on it
        taker.join(timeout=0.001)
    made = ConvertedFile(mmap.mmap(-1, 64))
    converted.put(path, made)
    taker.join(timeout=60)
    assert got == [made] and converted.take(path) is None
