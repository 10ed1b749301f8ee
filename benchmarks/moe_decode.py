"""MoE decode throughput at batch 64: pagedserve against transformers' continuous batching, in one run.

    python -m benchmarks.moe_decode [--threads 1] [--num-requests 64] [--output-len 128] [--only ...]

- Model: a random-weight Mixtral-shaped model (hidden 256, 4 layers, 8 heads over 4 KV heads, 8 experts of
  intermediate 512, top-2, vocab 8192; 17M parameters, 6.4M active per token), written once by transformers'
  save_pretrained into --model-dir.
- Requests: --num-requests requests of --prompt-len prompt tokens and --output-len output tokens each (all alike,
  so the run is --output-len decode steps at batch --num-requests after one prefill), greedy, EOS off.
- Both sides, the threads and the timing are benchmarks/vs_transformers.py's (this calls its main): pagedserve's
  two services as processes (max-num-seqs = the batch) against transformers' `continuous_batching_context_manager`
  with the same budgets, in the same run and on the same threads. It prints both sides' useful output tokens/s and
  their ratio, against issue #32's target of 3x.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from benchmarks import vs_transformers

DEFAULT_DIR = vs_transformers.DEFAULT_CACHE / "bench-mixtral-17m"
SHAPE: dict[str, Any] = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
         "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def ensure_mixtral(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**SHAPE), dtype=torch.float32)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", choices=["pagedserve", "transformers"], default=None)
    p.add_argument("--executor-args", default="", help="more executor flags, e.g. '--cpu-threads 2'")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    model = ensure_mixtral(args.model_dir)
    n = str(args.num_requests)
    forwarded = ["--model-dir", str(model), "--num-requests", n, "--max-num-seqs", n, "--sigma", "0",
                 "--input-mean", str(args.prompt_len), "--input-max", str(args.prompt_len),
                 "--output-mean", str(args.output_len), "--output-max", str(args.output_len),
                 "--threads", str(args.threads), "--repeats", str(args.repeats), "--target-ratio", "3"]
    forwarded += ["--only", args.only] if args.only else []
    forwarded += ["--json-out", args.json_out] if args.json_out else []
    forwarded += ["--executor-args", args.executor_args] if args.executor_args else []
    vs_transformers.main(forwarded)


if __name__ == "__main__":
    main()
