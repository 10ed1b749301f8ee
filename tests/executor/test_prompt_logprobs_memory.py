"""Prompt logprobs at a Qwen-sized vocabulary (151,936 tokens) in the torch backend's real model path: a prompt
chunk's logits are turned into logprobs a slice of rows at a time (runner/prompt_logprobs.py), so the executor's
peak memory grows by a bounded amount however long the chunk, and the answer equals the one computed whole.

The peak is the whole process's (VmHWM), so it is measured in a process of its own: in a long-lived pytest process
(an xdist worker) other tests' backends may still be packing their weights on background threads, and their
allocations would count as this pass's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.runner import prompt_logprobs
from executor_service.runner.torch_backend import TorchBackend
from tests.support.procs import ROOT, status_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 151_936
PROMPT = 1_024  # one chunk: 1,023 prompt rows, 0.6 GB of float32 logits had they been made at once
BLOCK = 16
K = 5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("qwen-vocab")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def create_backend(path: Path) -> TorchBackend:
    backend = TorchBackend.create(ExecutorConfig(model=str(path), device="cpu", block_size=BLOCK,
                                                 num_gpu_blocks=PROMPT // BLOCK + 8, num_cpu_blocks=0, seed=0,
                                                 max_num_batched_tokens=PROMPT))
    backend.wait_for_packing()  # the packing after ready measures its GEMMs: not while a test measures memory
    return backend


def prompt_item(prompt: list[int], k: int | None = K) -> BatchItem:
    blocks = list(range(len(prompt) // BLOCK + 1))
    return BatchItem("p", list(prompt), len(prompt), 0, len(prompt), blocks, True,
                     SamplingConfig(temperature=0.0, prompt_logprobs=k))


def peak_growth(run: Callable[[], object]) -> int:
    """How far this process's peak resident memory rose above its resident memory while `run` ran."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the present VmRSS
    before = status_bytes(os.getpid(), "VmRSS")
    run()
    return status_bytes(os.getpid(), "VmHWM") - before


def measure_peaks(path: str) -> None:
    """Print, as JSON, how far one prompt chunk's pass raised this process's peak memory without prompt logprobs
    and with them, and how many prompt rows got logprobs (run in a fresh process by the test below)."""
    backend = create_backend(Path(path))
    prompt = [(7 * i) % VOCAB for i in range(PROMPT)]
    backend.execute([prompt_item(prompt, None)])  # warm: the pass's own buffers are allocated once
    plain = peak_growth(lambda: backend.execute([prompt_item(prompt, None)]))
    item = prompt_item(prompt)
    asking = peak_growth(lambda: backend.execute([item]))
    rows = len(item.prompt_out.tokens) if item.prompt_out is not None else 0
    print(json.dumps({"plain": plain, "asking": asking, "rows": rows}))


def test_a_long_prompt_chunk_with_prompt_logprobs_keeps_the_peak_memory_bounded(model_path: Path) -> None:
    code = f"from tests.executor.test_prompt_logprobs_memory import measure_peaks; measure_peaks({str(model_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["rows"] == PROMPT - 1
    whole = PROMPT * VOCAB * 4  # the chunk's float32 logits, once
    # a slice of rows at a time: LOGIT_ELEMENTS logits (64 MiB) and their logprobs, not the chunk's 0.6 GB twice
    assert peaks["asking"] - peaks["plain"] < whole // 2, (peaks, whole)


def test_slices_give_the_logprobs_computed_whole(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = create_backend(model_path)
    prompt = [(11 * i + 5) % VOCAB for i in range(40)]
    whole = prompt_item(prompt)
    backend.execute([whole])
    monkeypatch.setattr(prompt_logprobs, "LOGIT_ELEMENTS", 3 * VOCAB)  # three rows a slice: 13 slices of 38 rows
    sliced = prompt_item(prompt)
    backend.execute([sliced])
    assert whole.prompt_out is not None and sliced.prompt_out is not None
    assert whole.prompt_out.first_position == sliced.prompt_out.first_position == 1
    for a, b in zip(whole.prompt_out.tokens, sliced.prompt_out.tokens, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs] and len(a.top_logprobs) == K
