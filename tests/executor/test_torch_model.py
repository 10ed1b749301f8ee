"""Torch executor backend: greedy equality with transformers, chunked prefill, swap/copy, loader errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.__main__ import main
from executor_service.default_model.model import ensure_default_model, ensure_random_model, make_model
from executor_service.model import ModelConfig, ModelLoadError
from executor_service.runner.torch_backend import TorchBackend

transformers = pytest.importorskip("transformers")

GREEDY = SamplingConfig(temperature=0.0)
BLOCK_SIZE = 8
PROMPT_LENGTHS = (1, 5, 17, 64, 300)
CHUNK = 128
NEW_TOKENS = 8
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, dict[str, object]] = {
    "llama": {"arch": "llama", "seed": 1},
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": True, "seed": 2},
    "llama3_rope": {"arch": "llama", "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "seed": 3},
    "mistral": {"arch": "mistral", "num_kv_heads": 1, "seed": 4},
}


@dataclass
class Seq:
    request_id: str
    tokens: list[int]
    num_prompt: int
    sampling: SamplingConfig = GREEDY
    computed: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


class Driver:
    """A minimal scheduler: allocates blocks on demand and drives prefill chunks and decodes."""

    def __init__(self, backend: TorchBackend) -> None:
        self.backend = backend
        self.block_size = backend.info.block_size
        self.free = list(range(backend.info.num_device_blocks))

    def allocate(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < num_tokens:
            seq.blocks.append(self.free.pop())

    def release(self, seq: Seq) -> None:
        self.free.extend(reversed(seq.blocks))
        seq.blocks = []

    def step(self, seqs: list[Seq], chunk: int) -> None:
        items = []
        for seq in seqs:
            n = min(chunk, len(seq.tokens) - seq.computed)
            self.allocate(seq, seq.computed + n)
            end = seq.computed + n
            items.append(BatchItem(seq.request_id, list(seq.tokens), seq.num_prompt, seq.computed, n,
                                   list(seq.blocks), end == len(seq.tokens), seq.sampling))
        outputs = self.backend.execute(items)
        for seq, item, out in zip(seqs, items, outputs, strict=True):
            seq.computed += item.num_tokens
            if out is not None:
                seq.tokens.append(out.token_id)

    def generate(self, seqs: list[Seq], max_new: int, chunk: int = CHUNK) -> None:
        while active := [s for s in seqs if s.num_generated < max_new]:
            self.step(active, chunk)


@dataclass
class Bundle:
    path: Path
    backend: TorchBackend
    driver: Driver
    hf: object


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Bundle]:
    root = tmp_path_factory.mktemp("models")
    out: dict[str, Bundle] = {}
    for name, kwargs in VARIANTS.items():
        path = make_model(root / name, hidden_size=64, num_layers=2, num_heads=4, vocab_size=512,
                          init_std=0.2, **kwargs)  # type: ignore[arg-type]
        backend = TorchBackend.create(
            ExecutorConfig(model=str(path), device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks=256,
                           num_cpu_blocks=64, seed=0)
        )
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = Bundle(path, backend, Driver(backend), hf)
    return out


def make_prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def hf_greedy(hf: object, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,  # type: ignore[attr-defined]
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_same_tokens(ours: list[int], reference: list[int], eos: tuple[int, ...]) -> None:
    assert ours[: len(reference)] == reference
    if len(reference) < len(ours):
        assert reference[-1] in eos


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers_with_chunked_prefill(bundles: dict[str, Bundle], variant: str) -> None:
    bundle = bundles[variant]
    seqs = [Seq(f"{variant}-{n}", make_prompt(n, seed=n), n) for n in PROMPT_LENGTHS]
    bundle.driver.generate(seqs, NEW_TOKENS)
    for seq in seqs:
        reference = hf_greedy(bundle.hf, seq.tokens[: seq.num_prompt], NEW_TOKENS)
        assert_same_tokens(seq.tokens[seq.num_prompt :], reference, bundle.backend.info.eos_token_ids)
        bundle.driver.release(seq)


def test_recompute_after_preemption_gives_same_tokens(bundles: dict[str, Bundle]) -> None:
    bundle = bundles["llama"]
    prompt = make_prompt(37, seed=11)
    seq = Seq("pre", list(prompt), len(prompt))
    bundle.driver.generate([seq], 4, chunk=16)
    bundle.driver.release(seq)
    resumed = Seq("pre", list(seq.tokens), len(prompt))
    bundle.driver.generate([resumed], 10, chunk=16)
    bundle.driver.release(resumed)
    assert_same_tokens(resumed.tokens[len(prompt) :], hf_greedy(bundle.hf, prompt, 10),
                       bundle.backend.info.eos_token_ids)


def test_swap_out_then_in_to_other_blocks_preserves_continuation(bundles: dict[str, Bundle]) -> None:
    bundle = bundles["llama"]
    backend, driver = bundle.backend, bundle.driver
    prompt = make_prompt(45, seed=12)
    seq = Seq("swap", list(prompt), len(prompt))
    driver.generate([seq], 3)
    old_blocks = list(seq.blocks)
    cpu_blocks = list(range(10, 10 + len(old_blocks)))
    backend.swap_out(list(zip(old_blocks, cpu_blocks, strict=True)))
    driver.release(seq)
    backend.kv_cache.device_kv[:, :, old_blocks] = 0.0
    seq.blocks = [driver.free.pop(0) for _ in old_blocks]
    assert not set(seq.blocks) & set(old_blocks)
    backend.swap_in(list(zip(cpu_blocks, seq.blocks, strict=True)))
    driver.generate([seq], 9)
    driver.release(seq)
    assert_same_tokens(seq.tokens[len(prompt) :], hf_greedy(bundle.hf, prompt, 9), backend.info.eos_token_ids)


def test_copy_blocks_preserves_continuation(bundles: dict[str, Bundle]) -> None:
    bundle = bundles["qwen2"]
    backend, driver = bundle.backend, bundle.driver
    prompt = make_prompt(30, seed=13)
    seq = Seq("copy", list(prompt), len(prompt))
    driver.generate([seq], 2)
    old_blocks = list(seq.blocks)
    new_blocks = [driver.free.pop(0) for _ in old_blocks]
    backend.copy(list(zip(old_blocks, new_blocks, strict=True)))
    kv = backend.kv_cache.device_kv
    assert torch.equal(kv[:, :, old_blocks], kv[:, :, new_blocks])
    driver.release(seq)
    backend.kv_cache.device_kv[:, :, old_blocks] = 0.0
    seq.blocks = new_blocks
    driver.generate([seq], 8)
    driver.release(seq)
    assert_same_tokens(seq.tokens[len(prompt) :], hf_greedy(bundle.hf, prompt, 8), backend.info.eos_token_ids)


def test_seeded_sampling_is_independent_of_batch_and_preemption(bundles: dict[str, Bundle]) -> None:
    driver = bundles["llama"].driver
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, seed=1234)
    prompt = make_prompt(20, seed=14)
    alone = Seq("alone", list(prompt), len(prompt), sampling)
    driver.generate([alone], 8)
    driver.release(alone)
    first = Seq("first", list(prompt), len(prompt), sampling)
    others = [Seq("other", make_prompt(9, seed=15), 9, SamplingConfig(temperature=1.0))]
    driver.generate([*others, first], 4, chunk=7)
    driver.release(first)
    resumed = Seq("first", list(first.tokens), len(prompt), sampling)
    driver.generate([resumed, *others], 8, chunk=5)
    for seq in (resumed, *others):
        driver.release(seq)
    assert resumed.tokens == alone.tokens


def test_logprobs_are_raw_model_logprobs(bundles: dict[str, Bundle]) -> None:
    bundle = bundles["llama"]
    prompt = make_prompt(12, seed=16)
    sampling = SamplingConfig(temperature=0.7, repetition_penalty=1.3, logprobs=5, seed=3)
    out = bundle.backend.execute([BatchItem("lp", prompt, len(prompt), 0, len(prompt), list(range(2)), True,
                                            sampling)])[0]
    with torch.inference_mode():
        logits = bundle.hf(torch.tensor([prompt])).logits[0, -1]  # type: ignore[operator]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert out is not None and out.logprob is not None
    assert out.logprob == pytest.approx(float(expected[out.token_id]), abs=1e-4)
    assert [t for t, _ in out.top_logprobs] == expected.topk(5).indices.tolist()
    assert [v for _, v in out.top_logprobs] == pytest.approx(expected.topk(5).values.tolist(), abs=1e-4)


def test_backend_info_and_validation(bundles: dict[str, Bundle]) -> None:
    bundle = bundles["qwen2"]
    info = bundle.backend.info
    assert (info.model_id, info.vocab_size, info.eos_token_ids) == ("qwen2", 512, (2,))
    assert (info.block_size, info.num_device_blocks, info.num_swap_blocks) == (BLOCK_SIZE, 256, 64)
    assert (info.dtype, info.device, info.max_model_len) == ("float32", "cpu", 2048)
    assert (info.bos_token_id, info.add_bos_token) == (1, True)
    assert json.loads(info.tokenizer_json)["model"]["type"] == "BPE"
    too_short = BatchItem("x", list(range(3, 23)), 20, 0, 20, [0, 1], True, GREEDY)
    with pytest.raises(ValueError, match="need 3 blocks"):
        bundle.backend.execute([too_short])
    with pytest.raises(ValueError, match="block ids"):
        bundle.backend.execute([replace(too_short, block_table=[0, 1, 999])])
    with pytest.raises(ValueError, match="token ids"):
        bundle.backend.execute([replace(too_short, token_ids=[*range(3, 22), 512], block_table=[0, 1, 2])])
    assert bundle.backend.execute([]) == []


def test_config_reads_both_spellings(tmp_path: Path) -> None:
    new = ModelConfig.from_dir(make_model(tmp_path / "new", rope_scaling=LLAMA3_ROPE, rope_theta=5e5))
    old = ModelConfig.from_dir(make_model(tmp_path / "old", rope_scaling=LLAMA3_ROPE, rope_theta=5e5,
                                          legacy_config=True))
    raw_old = json.loads((tmp_path / "old" / "config.json").read_text())
    assert "torch_dtype" in raw_old and "rope_scaling" in raw_old and "rope_parameters" not in raw_old
    assert new == old
    assert new.rope_theta == 5e5 and new.rope_scaling is not None
    assert new.rope_scaling.original_max_position_embeddings == 64
    raw = {**raw_old, "eos_token_id": [2, 7], "architectures": ["Qwen2ForCausalLM"], "head_dim": 32}
    parsed = ModelConfig.from_dict(raw)
    assert parsed.eos_token_ids == (2, 7) and parsed.attention_bias and not parsed.o_proj_bias
    assert parsed.head_dim == 32


def test_mistral_sliding_window_no_longer_caps_max_model_len(tmp_path: Path) -> None:
    """The attention masks keys outside the window (tests/executor/test_model_families.py proves the tokens)."""
    path = make_model(tmp_path / "m", arch="mistral", num_layers=1)
    config_path = path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "sliding_window": 256}))
    assert create(path).info.max_model_len == 2048
    assert ModelConfig.from_dir(path).layer_windows == (256,)


def small_model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "src", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                      vocab_size=64)


def create(path: Path) -> TorchBackend:
    config = ExecutorConfig(model=str(path), device="cpu", num_gpu_blocks=4, num_cpu_blocks=2)
    return TorchBackend.create(config)


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"missing file config\.json"):
        create(tmp_path / "empty")


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = small_model(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \(GPT2LMHeadModel\)"):
        create(path)


def test_missing_weights_file_is_a_clear_error(tmp_path: Path) -> None:
    path = small_model(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file model\.safetensors"):
        create(path)


def test_missing_weight_is_a_clear_error(tmp_path: Path) -> None:
    path = small_model(tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing weight model\.layers\.0\.self_attn\.k_proj\.weight"):
        create(path)


def write_sharded(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    weights = load_file(src / "model.safetensors")
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, dst / file)
        weight_map.update(dict.fromkeys(keys, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tmp_path: Path) -> None:
    src = small_model(tmp_path)
    write_sharded(src, tmp_path / "sharded")
    single, sharded = create(src), create(tmp_path / "sharded")
    expected = sharded.model.state_dict()
    for name, tensor in single.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing weights file model-00002-of-00002\.safetensors"):
        create(tmp_path / "sharded")


def test_shipped_default_model_matches_transformers_and_writes_words(tmp_path: Path) -> None:
    path = ensure_default_model()
    assert path.name == "default-model-v2" and path.parent.name == "data"
    weights = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert sum(t.numel() * t.element_size() for t in weights.values()) < 8 * 2**20
    assert main([str(tmp_path / "copy")]) == 0
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    backend = TorchBackend.create(ExecutorConfig(device="cpu", num_gpu_blocks=32, num_cpu_blocks=0))
    assert backend.info.model_id == "default-model-v2" and backend.info.vocab_size == 2048
    assert "Assistant:" in backend.info.chat_template
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for text in ("Once upon a time, there was", "User: Why is the sky blue?\nAssistant:"):
        prompt = [1, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        seq = Seq("d", list(prompt), len(prompt))
        Driver(backend).generate([seq], 24)
        ours = seq.tokens[len(prompt) :]
        assert_same_tokens(ours, hf_greedy(hf, prompt, 24), backend.info.eos_token_ids)
        words = tokenizer.decode(ours, skip_special_tokens=True).split()
        assert len(words) >= 8 and sum(w.strip(".,!?\"").isalpha() for w in words) >= 0.8 * len(words), words


def test_random_benchmark_model_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = ensure_random_model()
    assert path == tmp_path / "cache" / "random-model-v1"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["random-model-v1"]
    assert ModelConfig.from_dir(path).hidden_size == 256


def test_kv_cache_rejects_bad_mappings(bundles: dict[str, Bundle]) -> None:
    backend = bundles["llama"].backend
    with pytest.raises(ValueError, match="swap_out destination"):
        backend.swap_out([(0, 64)])
    with pytest.raises(ValueError, match="swap_in source"):
        backend.swap_in([(-1, 0)])
    with pytest.raises(ValueError, match="duplicate destination"):
        backend.copy([(0, 5), (1, 5)])
    backend.copy([])


def test_half_precision_on_cpu_runs(tmp_path: Path) -> None:
    config = ExecutorConfig(model=str(small_model(tmp_path)), device="cpu", dtype="bfloat16",
                            num_gpu_blocks=4, num_cpu_blocks=2)
    backend = TorchBackend.create(config)
    assert backend.info.dtype == "bfloat16"
    sampling = SamplingConfig(temperature=0.8, seed=1, logprobs=2)
    seq = Seq("bf16", make_prompt(9, seed=18, vocab=64), 9, sampling)
    Driver(backend).generate([seq], 3)
    assert all(0 <= t < 64 for t in seq.tokens)
