"""--compile-sizes: the torch.compile'd forward gives transformers' greedy tokens, compiled steps and eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import make_model
from executor_service.runner.torch_backend import TorchBackend

transformers = pytest.importorskip("transformers")

GREEDY = SamplingConfig(temperature=0.0)
BLOCK_SIZE = 8
NEW_TOKENS = 8


def generate(backend: TorchBackend, prompts: list[list[int]], first_block: int) -> list[list[int]]:
    """Whole-prompt prefill of all prompts in one step, then greedy decodes of all of them together."""
    blocks_each = -(-(max(map(len, prompts)) + NEW_TOKENS) // BLOCK_SIZE)
    tables = [list(range(first_block + i * blocks_each, first_block + (i + 1) * blocks_each))
              for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    for _ in range(NEW_TOKENS):
        items = []
        for i, (seq, prompt, table) in enumerate(zip(seqs, prompts, tables, strict=True)):
            start = 0 if len(seq) == len(prompt) else len(seq) - 1
            items.append(BatchItem(str(i), seq, len(prompt), start, len(seq) - start, table, True, GREEDY))
        for seq, out in zip(seqs, backend.execute(items), strict=True):
            assert out is not None
            seq.append(out.token_id)
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def hf_greedy(path: Path, prompt: list[int]) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_compiled_forward_greedy_matches_transformers(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                      init_std=0.2, seed=5)
    backend = TorchBackend.create(ExecutorConfig(model=str(path), device="cpu", block_size=BLOCK_SIZE,
                                                 num_gpu_blocks=128, seed=0, compile_sizes=(4, 64),
                                                 cpu_gemm="onednn"))  # (a packed oneDNN linear broke the lowering)
    assert backend.compiled is not None
    generator = torch.Generator().manual_seed(0)
    batched = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 17, 30)]
    alone = torch.randint(3, 512, (80,), generator=generator).tolist()
    # 52 prompt tokens padded to 64 and 3 decodes padded to 4, compiled; an 80-token prefill runs eagerly,
    # then its decodes (1 token padded to 4) compiled again
    got = generate(backend, batched, first_block=0) + generate(backend, [alone], first_block=64)
    assert sorted(backend.compiled.compile_seconds) == [4, 64]
    assert backend.compiled.bucket(80) is None
    assert got == [hf_greedy(path, prompt) for prompt in [*batched, alone]]


def test_compile_sizes_flag() -> None:
    assert ExecutorConfig.from_args(["--compile-sizes", "16,1, 4"]).compile_sizes == (1, 4, 16)
    assert ExecutorConfig.from_args([]).compile_sizes == ()
    with pytest.raises(SystemExit):
        ExecutorConfig.from_args(["--compile-sizes", "0,4"])
