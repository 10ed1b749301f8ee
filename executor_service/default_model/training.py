"""Train the embedded default model on the shipped corpus, deterministically, on CPU.

`python -m executor_service.default_model train` runs it (fixed seeds, deterministic algorithms, a fixed thread
count) and writes the model in Hugging Face format with bfloat16 weights into
executor_service/default_model/data/default-model-v2.
With --copy-fraction and --init-from it fine-tunes a model on the corpus mixed with copy samples (a passage, a
blank line, the passage again: copy_samples.py); `ensure_copy_model()` builds COPY_RECIPE, the copy model that
benchmarks/speculative.py --copy-model uses, once and caches it under ~/.cache/pagedserve keyed by its recipe.
Training uses transformers' LlamaForCausalLM (a dev dependency), so the weights mean exactly what transformers
and our executor compute at inference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from executor_service.default_model import model as dm
from executor_service.default_model.copy_samples import copy_documents


@dataclass(slots=True, frozen=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.05
    seed: int = 0
    threads: int = 2
    log_every: int = 50
    copy_fraction: float = 0.0  # share of a batch's rows that are copy samples (copy_samples.py)
    copy_edit_share: float = 0.5  # share of copy samples whose repeat is edited
    copy_shuffle_share: float = 0.0  # share of copy samples whose passage has its words shuffled
    init_from: str | None = None  # fine-tune from this model directory's weights instead of a random init


@dataclass(slots=True, frozen=True)
class CopyStream:
    """The copy documents as one token stream, and where each document starts."""

    tokens: torch.Tensor
    starts: torch.Tensor


COPY_MODEL_NAME = "copy-model"
COPY_RECIPE = TrainConfig(steps=600, batch_size=8, seq_len=320, lr=3e-3, min_lr=3e-4, warmup=20, log_every=50,
                          copy_fraction=0.75, copy_edit_share=0.1, copy_shuffle_share=0.5,
                          init_from=str(dm.TRAINED_MODEL_DIR))


def documents(text: str) -> list[str]:
    return [doc.strip() for doc in text.split("\n\n") if doc.strip()]


def token_stream(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """Every document (blank-line separated) as BOS + tokens + EOS, concatenated."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents(text), add_special_tokens=False):
        ids += [dm.BOS_TOKEN_ID, *encoding.ids, dm.EOS_TOKEN_ID]
    return torch.tensor(ids, dtype=torch.long)


def copy_stream(tokenizer: Tokenizer, text: str, cfg: TrainConfig) -> CopyStream:
    """Every copy document that fits a training row whole, as BOS + tokens + EOS, concatenated; a row starts at
    a document's start, so its repeat always has the passage before it."""
    ids: list[int] = []
    starts: list[int] = []
    docs = copy_documents(documents(text), cfg.copy_edit_share, cfg.seed, cfg.copy_shuffle_share)
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        if len(encoding.ids) + 2 <= cfg.seq_len + 1:
            starts.append(len(ids))
            ids += [dm.BOS_TOKEN_ID, *encoding.ids, dm.EOS_TOKEN_ID]
    usable = [start for start in starts if start + cfg.seq_len + 1 <= len(ids)]
    return CopyStream(torch.tensor(ids, dtype=torch.long), torch.tensor(usable, dtype=torch.long))


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def sample_mixed(stream: torch.Tensor, copies: CopyStream, cfg: TrainConfig,
                 generator: torch.Generator) -> torch.Tensor:
    """A batch of corpus rows of which about copy_fraction are replaced by copy rows."""
    rows = sample_batch(stream, cfg, generator)
    picked = torch.rand(cfg.batch_size, generator=generator) < cfg.copy_fraction
    starts = copies.starts[torch.randint(0, len(copies.starts), (cfg.batch_size,), generator=generator)]
    for i in picked.nonzero().flatten().tolist():
        start = int(starts[i])
        rows[i] = copies.tokens[start : start + cfg.seq_len + 1]
    return rows


def build_hf_model(spec: dm.ModelSpec, init_from: str | None = None) -> torch.nn.Module:
    import transformers

    if init_from is not None:
        return transformers.LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32)
    config = transformers.LlamaConfig(**dm.build_config(spec))
    torch.manual_seed(spec.seed)
    return transformers.LlamaForCausalLM(config)


def train(out_dir: Path, cfg: TrainConfig, spec: dm.ModelSpec = dm.TRAINED_SPEC) -> float:
    """Train, write the model to out_dir, return the final training loss (mean over the last log window)."""
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    tokenizer = dm.train_tokenizer()
    text = dm.read_corpus()
    stream = token_stream(tokenizer, text)
    copies = copy_stream(tokenizer, text, cfg) if cfg.copy_fraction > 0 else None
    model = build_hf_model(spec, cfg.init_from).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    print(f"corpus: {len(stream)} tokens; model: {sum(p.numel() for p in model.parameters())} parameters", flush=True)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        batch = sample_batch(stream, cfg, generator) if copies is None else sample_mixed(stream, copies, cfg, generator)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % cfg.log_every == 0:
            window = sum(losses[-cfg.log_every :]) / cfg.log_every
            print(f"step {step + 1}/{cfg.steps} loss {window:.3f} {time.perf_counter() - start:.0f}s", flush=True)
    write_trained(out_dir, model, tokenizer, spec)
    return sum(losses[-cfg.log_every :]) / min(len(losses), cfg.log_every)


def write_trained(out_dir: Path, model: torch.nn.Module, tokenizer: Tokenizer, spec: dm.ModelSpec) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()
               if not (spec.tie_word_embeddings and name == "lm_head.weight")}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = dm.build_config(spec)
    config["dtype"] = "bfloat16"
    dm.write_json(out_dir / "config.json", config)
    dm.write_tokenizer_files(out_dir, spec, tokenizer)


def recipe_key(cfg: TrainConfig, spec: dm.ModelSpec) -> str:
    """A digest of everything the trained weights depend on: the settings, the spec, the corpus, and the weights
    it starts from (their bytes, not their path)."""
    digest = hashlib.sha256(json.dumps([asdict(replace(cfg, init_from=None)), asdict(spec)], sort_keys=True).encode())
    digest.update(dm.read_corpus().encode())
    if cfg.init_from is not None:
        digest.update((Path(cfg.init_from) / "model.safetensors").read_bytes())
    return digest.hexdigest()[:16]


def ensure_trained(name: str, cfg: TrainConfig, spec: dm.ModelSpec = dm.TRAINED_SPEC) -> Path:
    """The model these settings train, cached under the cache directory as NAME-<recipe key>; trained (into a
    temporary directory, renamed into place) the first time."""
    final = dm.cache_dir() / f"{name}-{recipe_key(cfg, spec)}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        train(tmp, cfg, spec)
        tmp.chmod(0o755)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_copy_model() -> Path:
    """The default model fine-tuned to copy (COPY_RECIPE), built on first use (a few minutes on 2 CPU cores)."""
    return ensure_trained(COPY_MODEL_NAME, COPY_RECIPE)


def parse_args(argv: list[str]) -> tuple[Path, TrainConfig]:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m executor_service.default_model train",
                                description="Train the embedded default model on the shipped corpus.")
    p.add_argument("--out", type=Path, default=dm.TRAINED_MODEL_DIR, help="output directory (default: the package's)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (cosine decay after warmup)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed for batch sampling")
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads (fixed for determinism)")
    p.add_argument("--copy-fraction", type=float, default=0.0,
                   help="share of each batch that is copy samples (a passage, a blank line, the passage again)")
    p.add_argument("--init-from", default=None, help="fine-tune from this model directory (default: random init)")
    args = p.parse_args(argv)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      min_lr=args.lr / 10, seed=args.seed, threads=args.threads, copy_fraction=args.copy_fraction,
                      init_from=args.init_from)
    return args.out, cfg


def main(argv: list[str]) -> int:
    out, cfg = parse_args(argv)
    loss = train(out, cfg)
    print(f"final loss {loss:.3f}; wrote {out}")
    return 0
