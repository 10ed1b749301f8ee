"""Train the embedded default model on the shipped corpus, deterministically, on CPU.

`python -m executor_service.default_model train` runs it (fixed seeds, deterministic algorithms, a fixed thread
count) and writes the model in Hugging Face format with bfloat16 weights into
executor_service/default_model/data/default-model-v2.
With --copy-fraction and --init-from it fine-tunes a model on the corpus mixed with copy samples (a passage, a
blank line, the passage again: copy_samples.py), optionally after a warm-up on random-token repeat rows
(repeat_samples.py) and with repeat rows mixed in, probing in process how well the model copies
(copy_check.py) every probe_every steps; `ensure_copy_model()` builds COPY_RECIPE and then COPY_CONTINUATION from
its best weights, the copy model that benchmarks/speculative.py --copy-model uses, once, and caches each under
~/.cache/pagedserve keyed by its recipe.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from executor_service.default_model import model as dm
from executor_service.default_model.copy_check import SEPARATOR, probe_copying
from executor_service.default_model.copy_samples import copy_documents
from executor_service.default_model.repeat_samples import IGNORE, Batch, RepeatSpec, corpus_vocab, repeat_batch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


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
    copy_repeat_loss_only: bool = False  # a copy row's loss only from its repeat on (the passage's own loss off)
    init_from: str | None = None  # fine-tune from this model directory's weights instead of a random init
    repeat_steps: int = 0  # copy warm-up: steps of repeat rows only (repeat_samples.py) before the corpus stage
    repeat_min_len: int = 8  # a repeat row's random segment: at least this many tokens
    repeat_max_len: int = 160  # ... and at most this many (and half the row)
    repeat_fraction: float = 0.0  # share of the corpus stage's rows that are repeat rows
    probe_every: int = 0  # every this many steps, probe_copying on quote prompts (0: never)
    probe_patience: int = 0  # corpus stage: stop after this many probes without a gain of probe_min_gain (0: never)
    probe_min_gain: float = 0.02  # in quote fidelity (copy_check.quote_fidelity, 0 - 1)


@dataclass(slots=True)
class Progress:
    """What a training run did: its probes (step, n-gram tokens per step, quote fidelity), the best fidelity of
    the corpus stage, the steps run, the seconds."""

    probes: list[tuple[int, float, float]] = field(default_factory=list)
    best: float = -1.0
    steps_run: int = 0
    seconds: float = 0.0


@dataclass(slots=True, frozen=True)
class CopyStream:
    """The copy documents as one token stream, where each document starts, and at what offset from its start
    its repeat begins (the first token after the passage and the separator)."""

    tokens: torch.Tensor
    starts: torch.Tensor
    repeat_at: torch.Tensor


COPY_MODEL_NAME = "copy-model"
TRAINING_LOG = "training_log.json"  # a probed run's Progress, beside its weights
COPY_RECIPE = TrainConfig(steps=600, batch_size=6, seq_len=448, lr=3e-3, min_lr=3e-4, warmup=20, log_every=25,
                          copy_fraction=0.75, copy_edit_share=0.0, copy_shuffle_share=0.25, copy_repeat_loss_only=True,
                          init_from=str(dm.TRAINED_MODEL_DIR), repeat_steps=0, repeat_min_len=8, repeat_max_len=200,
                          repeat_fraction=0.15, probe_every=100, probe_patience=3, probe_min_gain=0.02)
# a second cosine cycle from COPY_RECIPE's best weights (its copy loss was still falling fast at its end)
COPY_CONTINUATION = replace(COPY_RECIPE, steps=400, lr=2e-3, min_lr=2e-4, warmup=10, probe_patience=2, init_from=None)


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
    starts: dict[int, int] = {}
    docs = copy_documents(documents(text), cfg.copy_edit_share, cfg.seed, cfg.copy_shuffle_share)
    heads = tokenizer.encode_batch([doc.split(SEPARATOR, 1)[0] + SEPARATOR for doc in docs], add_special_tokens=False)
    for encoding, head in zip(tokenizer.encode_batch(docs, add_special_tokens=False), heads, strict=True):
        if len(encoding.ids) + 2 <= cfg.seq_len + 1:
            starts[len(ids)] = 1 + len(head.ids)
            ids += [dm.BOS_TOKEN_ID, *encoding.ids, dm.EOS_TOKEN_ID]
    usable = [start for start in starts if start + cfg.seq_len + 1 <= len(ids)]
    return CopyStream(torch.tensor(ids, dtype=torch.long), torch.tensor(usable, dtype=torch.long),
                      torch.tensor([starts[s] for s in usable], dtype=torch.long))


def lr_at(step: int, cfg: TrainConfig, total: int | None = None) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay to min_lr at `total` (default cfg.steps)."""
    steps = cfg.steps if total is None else total
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def sample_mixed(stream: torch.Tensor, copies: CopyStream, cfg: TrainConfig, generator: torch.Generator) -> Batch:
    """A batch of corpus rows of which about copy_fraction are replaced by copy rows (with copy_repeat_loss_only,
    their targets before the repeat IGNORE)."""
    rows = sample_batch(stream, cfg, generator)
    picked = torch.rand(cfg.batch_size, generator=generator) < cfg.copy_fraction
    chosen = torch.randint(0, len(copies.starts), (cfg.batch_size,), generator=generator)
    masked: list[tuple[int, int]] = []
    for i in picked.nonzero().flatten().tolist():
        start = int(copies.starts[chosen[i]])
        rows[i] = copies.tokens[start : start + cfg.seq_len + 1]
        masked.append((i, int(copies.repeat_at[chosen[i]])))
    batch = Batch(rows[:, :-1].clone(), rows[:, 1:].clone())
    for i, repeat_at in masked if cfg.copy_repeat_loss_only else []:
        batch.targets[i, : repeat_at - 1] = IGNORE
    return batch


@dataclass(slots=True, frozen=True)
class Sources:
    """Where a run's rows come from: the corpus stream, its copy documents, the repeat rows' makings."""

    stream: torch.Tensor
    copies: CopyStream | None
    repeats: RepeatSpec


def load_sources(tokenizer: Tokenizer, text: str, cfg: TrainConfig) -> Sources:
    stream = token_stream(tokenizer, text)
    copies = copy_stream(tokenizer, text, cfg) if cfg.copy_fraction > 0 else None
    separator = tuple(tokenizer.encode(SEPARATOR, add_special_tokens=False).ids)
    vocab = corpus_vocab(stream, (dm.BOS_TOKEN_ID, dm.EOS_TOKEN_ID))
    return Sources(stream, copies, RepeatSpec(vocab, separator, dm.BOS_TOKEN_ID, cfg.repeat_min_len,
                                              cfg.repeat_max_len))


def corpus_batch(sources: Sources, cfg: TrainConfig, generator: torch.Generator) -> Batch:
    """Corpus rows, about copy_fraction of them copy documents, then about repeat_fraction repeat rows."""
    if sources.copies is None:
        rows = sample_batch(sources.stream, cfg, generator)
        batch = Batch(rows[:, :-1].clone(), rows[:, 1:].clone())
    else:
        batch = sample_mixed(sources.stream, sources.copies, cfg, generator)
    if cfg.repeat_fraction <= 0:
        return batch
    picked = torch.rand(cfg.batch_size, generator=generator) < cfg.repeat_fraction
    if picked.any():
        repeats = repeat_batch(sources.repeats, int(picked.sum()), cfg.seq_len, generator)
        batch.inputs[picked], batch.targets[picked] = repeats.inputs, repeats.targets
    return batch


def build_hf_model(spec: dm.ModelSpec, init_from: str | None = None) -> LlamaForCausalLM:
    import transformers

    if init_from is not None:
        return transformers.LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32)
    config = transformers.LlamaConfig(**dm.build_config(spec))
    torch.manual_seed(spec.seed)
    return transformers.LlamaForCausalLM(config)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(input_ids=batch.inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1),
                                             ignore_index=IGNORE)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.item())


class CopyWatch:
    """The in-process copy probe every cfg.probe_every steps: records each probe, keeps the best weights, and says
    when to stop (probe_patience probes in a row without a gain of probe_min_gain over the best)."""

    def __init__(self, tokenizer: Tokenizer, text: str, cfg: TrainConfig) -> None:
        self.tokenizer, self.text, self.cfg = tokenizer, text, cfg
        self.progress = Progress()
        self.best_state: dict[str, torch.Tensor] | None = None
        self.stale = 0

    def observe(self, model: LlamaForCausalLM, step: int, keep: bool) -> bool:
        """Probe the model at this step (of the whole run); True when the run should stop. keep: this stage's
        weights may be the result (the best by quote fidelity kept, stopping allowed)."""
        score = probe_copying(model, self.tokenizer, self.text, dm.BOS_TOKEN_ID)
        fidelity = round(score.fidelity, 3)
        self.progress.probes.append((step, round(score.tokens_per_step, 3), fidelity))
        print(f"step {step}: copy probe {score.tokens_per_step:.2f} tokens per step, fidelity {fidelity:.3f}",
              flush=True)
        if not keep:
            return False
        gained = fidelity >= self.progress.best + self.cfg.probe_min_gain
        if fidelity > self.progress.best:
            self.progress.best = fidelity
            self.best_state = {name: t.detach().clone() for name, t in model.state_dict().items()}
        self.stale = 0 if gained else self.stale + 1
        return 0 < self.cfg.probe_patience <= self.stale


def run_stage(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, make_batch: Callable[[], Batch],
              steps: int, cfg: TrainConfig, watch: CopyWatch | None, keep: bool) -> list[float]:
    """`steps` optimizer steps on make_batch's rows (a cosine schedule of their own); stops early when the watch
    says so. Returns the losses."""
    losses: list[float] = []
    done = watch.progress.steps_run if watch else 0
    start = time.perf_counter()
    for step in range(steps):
        losses.append(train_step(model, optimizer, make_batch(), lr_at(step, cfg, steps)))
        if (step + 1) % cfg.log_every == 0:
            window = sum(losses[-cfg.log_every :]) / cfg.log_every
            print(f"step {done + step + 1} loss {window:.3f} {time.perf_counter() - start:.0f}s", flush=True)
        if watch and cfg.probe_every and (step + 1) % cfg.probe_every == 0 and \
                watch.observe(model, done + step + 1, keep):
            break
    if watch:
        watch.progress.steps_run = done + len(losses)
    return losses


def train(out_dir: Path, cfg: TrainConfig, spec: dm.ModelSpec = dm.TRAINED_SPEC) -> float:
    """Train (the copy warm-up on repeat rows if cfg.repeat_steps, then the corpus stage), write the model to
    out_dir (the best probed weights of the corpus stage when probe_patience is set), return the final training
    loss (mean over the last log window)."""
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    tokenizer = dm.train_tokenizer()
    text = dm.read_corpus()
    sources = load_sources(tokenizer, text, cfg)
    model = build_hf_model(spec, cfg.init_from).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    watch = CopyWatch(tokenizer, text, cfg) if cfg.probe_every else None
    print(f"corpus: {len(sources.stream)} tokens; model: {sum(p.numel() for p in model.parameters())} parameters",
          flush=True)
    started = time.perf_counter()
    run_stage(model, optimizer, lambda: repeat_batch(sources.repeats, cfg.batch_size, cfg.seq_len, generator),
              cfg.repeat_steps, cfg, watch, keep=False)
    losses = run_stage(model, optimizer, lambda: corpus_batch(sources, cfg, generator), cfg.steps, cfg, watch,
                       keep=True)
    if watch and watch.best_state is not None and cfg.probe_patience:
        model.load_state_dict(watch.best_state)
    write_trained(out_dir, model, tokenizer, spec)
    if watch:
        watch.progress.seconds = round(time.perf_counter() - started, 1)
        dm.write_json(out_dir / TRAINING_LOG, asdict(watch.progress))
    return sum(losses[-cfg.log_every :]) / max(1, min(len(losses), cfg.log_every))


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
    """The default model fine-tuned to copy: COPY_RECIPE, then COPY_CONTINUATION from its (best probed) weights,
    each built on first use (minutes on 2 CPU cores) and cached under its own key."""
    first = ensure_trained(COPY_MODEL_NAME, COPY_RECIPE)
    return ensure_trained(f"{COPY_MODEL_NAME}-continued", replace(COPY_CONTINUATION, init_from=str(first)))


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
