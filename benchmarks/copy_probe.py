"""Does the model copy its prompt? The best case of n-gram speculation on copy-style prompts, load-independent.

    python benchmarks/copy_probe.py [--prompts 16] [--output-len 128] [--iterations 6] [--k 4]
        [--model DIR | --copy-model]

Starts one torch executor (the embedded default model; --model DIR another, --copy-model the default model
fine-tuned to copy, as benchmarks/speculative.py) and a scheduler without speculation, and asks greedy
continuations of prompts built from the model's own corpus and its own outputs:

- para+third: a corpus paragraph, a blank line, its first third again (benchmarks/speculative.py's copy set);
- para2x+third: the paragraph twice, then its first third;
- own+seed: a seed sentence, the model's own greedy continuation of it, a blank line, the seed again (the answer
  would quote the prompt if the model's continuation did not depend on what came before the seed);
- fixed point: own+seed iterated, each time with the passage replaced by the last answer; a prompt converges when
  the answer equals the passage in its prompt (then the whole answer is a quote).

For each set it prints the output tokens per step that n-gram speculation (k drafts, prompt_lookup 2-5) would
reach if it drafted at every step and a verification cost nothing more than a decode (the upper bound of its
speed-up at concurrency 1), and for the fixed point how many answer tokens equal the passage. For the first set
it also checks that the greedy answers equal transformers' `generate` token for token (--check 0 skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks.speculative import DEFAULT_MODEL, free_prompt, paragraphs, served_model
from client.lib import PagedServeClient
from client.local import service
from executor_service.default_model.copy_check import ngram_tokens_per_step


async def greedy(address: str, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    async with PagedServeClient(address) as client:
        async def one(ids: list[int]) -> list[int]:
            out: list[int] = []
            async for r in client.generate(None, ids, max_tokens=output_len, temperature=0.0, ignore_eos=True):
                out += list(r.token_ids)
            return out
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def transformers_greedy(model: Path, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Greedy continuations by transformers' generate, EOS ignored (the peer of the executor's)."""
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--model", default=None, help="the executor's model directory (default: the embedded model)")
    p.add_argument("--copy-model", action="store_true", help="the default model fine-tuned to copy (cached)")
    p.add_argument("--check", type=int, default=4, help="compare this many greedy answers with transformers'")
    args = p.parse_args()
    model = served_model(args.model, args.copy_model)
    executor_args = ["--device", "cpu", "--num-gpu-blocks", "4096", *(["--model", model] if model else [])]
    tok = Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)
    sep, found = enc("\n\n"), paragraphs(args.prompts)
    paras, seeds = [enc(x) for x in found], [enc(free_prompt(x)) for x in found]
    record: dict[str, object] = {"benchmark": "copy_probe", "k": args.k, "output_len": args.output_len,
                                 "model": model or str(DEFAULT_MODEL)}
    with service("executor_service", executor_args, name="executor") as ex, \
            service("scheduler_service", ["--executor", ex.address, "--api-server-count", "0"], name="sched") as s:
        own = asyncio.run(greedy(s.address, seeds, args.output_len))
        sets = {"para+third": [x + sep + x[:len(x) // 3] for x in paras],
                "para2x+third": [x + sep + x + sep + x[:len(x) // 3] for x in paras],
                "own+seed": [sd + o + sep + sd for sd, o in zip(seeds, own, strict=True)]}
        for name, prompts in sets.items():
            outputs = asyncio.run(greedy(s.address, prompts, args.output_len))
            record[name] = mean([ngram_tokens_per_step(q, o, args.k) for q, o in zip(prompts, outputs, strict=True)])
            print(f"{name:>14}: n-gram best case {record[name]} output tokens per step", file=sys.stderr)
            if name == "para+third" and args.check:
                peer = transformers_greedy(Path(model or DEFAULT_MODEL), prompts[:args.check], args.output_len)
                record["equal_to_transformers"] = sum(a == b for a, b in zip(peer, outputs, strict=False))
                print(f"{record['equal_to_transformers']}/{args.check} greedy answers equal transformers'",
                      file=sys.stderr)
        passage = own
        for it in range(args.iterations):
            prompts = [sd + x + sep + sd for sd, x in zip(seeds, passage, strict=True)]
            outputs = asyncio.run(greedy(s.address, prompts, args.output_len))
            same = [sum(a == b for a, b in zip(x, o, strict=True)) for x, o in zip(passage, outputs, strict=True)]
            converged = sum(n == args.output_len for n in same)
            best = mean([ngram_tokens_per_step(q, o, args.k) for q, o in zip(prompts, outputs, strict=True)])
            record[f"fixed_point_{it}"] = {"converged": converged, "mean_equal_tokens": mean([float(n) for n in same]),
                                           "tokens_per_step": best}
            print(f"fixed point {it}: {converged}/{len(prompts)} answers equal their passage, "
                  f"{mean([float(n) for n in same])} of {args.output_len} tokens equal on average, n-gram best case "
                  f"{best} tokens per step", file=sys.stderr)
            passage = outputs
    print(json.dumps(record))


if __name__ == "__main__":
    main()
