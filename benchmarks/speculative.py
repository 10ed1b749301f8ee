"""Speculative decoding (n-gram) on vs off, on the same executor in one run.

    python benchmarks/speculative.py [--concurrency 1 8 64] [--requests-per-level 1] [--min-requests 4]
        [--output-len 128] [--num-speculative-tokens 4] [--rounds 3] [--device cpu] [--threads 1] [--datasets copy free]
        [--scheduler-flags "--no-async-scheduling"] [--method ngram|draft_model] [--draft-model DIR]
        [--model DIR | --copy-model]

Both services run as processes: one torch executor (the embedded default model), then for each setting a
scheduler with --speculative-config '{"method": "ngram", ...}' and one without, against it in turn, --rounds
times in alternating order (the figures are the medians of the rounds: a shared machine's load drifts). Two
reproducible datasets from the default model's own corpus (executor_service/default_model/data, made by a
seeded generator):

- copy: an edit-style workload whose answers repeat spans of their prompts -- each prompt is a corpus
  paragraph, a blank line, and the paragraph's first third again; greedy continuation copies much of the rest.
- free: each prompt is the first sentence of a paragraph; the model writes on freely (no copying asked).

At each concurrency level, max(level * requests_per_level, min_requests) requests go out with at most `level` in
flight (greedy, ignore_eos, output_len tokens each; with --stop-at-eos an answer ends at the model's EOS, so a
quote ends where the model ends it: greedy answers are the same with speculation on and off, so are their lengths).
Prints, per dataset and level, output tok/s with speculation on and off and their ratio, the same per CPU second of
the executor and scheduler processes and per second the executor spent in its steps (steadier than wall time on a
shared machine), output tokens per executor step (load-independent), and the acceptance the scheduler's metrics
report; one JSON line at the end.

--model DIR serves another model (same tokenizer: the datasets are text) and --copy-model the default model
fine-tuned to copy (executor_service/default_model/training.py COPY_RECIPE: the corpus mixed with "a passage, a
blank line, the passage again" samples; trained on first use, a few minutes, and cached under ~/.cache/pagedserve
keyed by its recipe). The default model does not copy (benchmarks/copy_probe.py), so the copy set measures the
n-gram proposer's speed-up only with a model that does, as any pretrained LLM does on quote and edit prompts.

--method draft_model starts the executor with --draft-model DIR (default: the embedded default model, the model
as its own draft: every greedy draft is accepted, and each drafted step costs k - 1 extra draft passes and a
draft catch-up; it measures the mechanics, not a useful draft) and the speculative scheduler with
{"method": "draft_model", ...}; both settings run against that executor (with speculation off the draft model is
idle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.bench.datasets import BenchRequest
from client.bench.record import machine
from client.bench.runner import RunConfig, run_benchmark
from client.lib import PagedServeClient
from client.local import Service, free_port, parse_metrics, service
from executor_service.default_model.copy_check import quote_passages, quote_prompt

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "executor_service/default_model/data/generated_corpus.txt"
DEFAULT_MODEL = ROOT / "executor_service/default_model/data/default-model-v2"
SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")
STEPS = "pagedserve:executor_step_seconds_count"
BUSY = "pagedserve:executor_busy_seconds_total"


def paragraphs(count: int) -> list[str]:
    return quote_passages(CORPUS.read_text(encoding="utf-8"), count)


def free_prompt(paragraph: str) -> str:
    return paragraph.split(". ")[0] + "."


def dataset(name: str, count: int, output_len: int) -> list[BenchRequest]:
    make = quote_prompt if name == "copy" else free_prompt
    prompts = [make(p) for p in paragraphs(count)]
    return [BenchRequest(prompt_len=len(p) // 4, max_tokens=output_len, prompt=p) for p in prompts]


async def measure(address: str, requests: list[BenchRequest], concurrency: int,
                  start: Callable[[], None], stop_at_eos: bool = False) -> dict[str, float]:
    """One warm-up request, then `start()` (the counters' snapshot) and the run."""
    config = RunConfig(max_concurrency=concurrency, ignore_eos=not stop_at_eos, show_progress=False)
    async with PagedServeClient(address) as client:
        await run_benchmark(client, requests[:1], config)
        start()
        result = await run_benchmark(client, requests, config)
    ok = [t for t in result.traces if t.success]
    outputs = sum(t.output_len for t in ok)
    return {"completed": len(ok), "failed": len(result.traces) - len(ok), "duration_s": round(result.duration, 2),
            "output_tokens": outputs, "output_tok_s": round(outputs / result.duration, 1)}


def cpu_seconds(*pids: int) -> float:
    """User + system CPU time of these processes (all their threads) so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def scrape(port: int) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


def run_setting(executor: Service, spec: str | None, work: dict[tuple[str, int], list[BenchRequest]],
                log_dir: Path | None, extra: list[str],
                stop_at_eos: bool = False) -> dict[tuple[str, int], dict[str, float]]:
    port = free_port()
    flags = ["--executor", executor.address, "--metrics-port", str(port), "--api-server-count", "0", *extra]
    if spec is not None:
        flags += ["--speculative-config", spec]
    results: dict[tuple[str, int], dict[str, float]] = {}
    with service("scheduler_service", flags, log_dir, name="scheduler-spec" if spec else "scheduler-plain") as s:
        for (name, level), requests in work.items():
            pids = (executor.proc.pid, s.proc.pid)
            before: dict[str, float] = {}

            def snapshot() -> None:
                before.update(scrape(port), cpu=cpu_seconds(*pids))  # noqa: B023 - called within this iteration
            run = asyncio.run(measure(s.address, requests, level, snapshot, stop_at_eos))
            after = scrape(port)
            run["cpu_s"] = round(cpu_seconds(*pids) - before["cpu"], 2)
            run["cpu_tok_s"] = round(run["output_tokens"] / run["cpu_s"], 1) if run["cpu_s"] else 0.0
            steps = after.get(STEPS, 0.0) - before.get(STEPS, 0.0)
            run["tokens_per_step"] = round(run["output_tokens"] / steps, 2) if steps else 0.0
            busy = after.get(BUSY, 0.0) - before.get(BUSY, 0.0)
            run["busy_tok_s"] = round(run["output_tokens"] / busy, 1) if busy else 0.0
            for metric in SPEC_METRICS:
                run[metric.removeprefix("vllm:spec_decode_").removesuffix("_total")] = \
                    after.get(metric, 0.0) - before.get(metric, 0.0)
            results[(name, level)] = run
            print(f"{'spec' if spec else 'plain'} {name} c={level}: {run}", file=sys.stderr, flush=True)
    return results


def medians(runs: list[dict[tuple[str, int], dict[str, float]]]) -> dict[tuple[str, int], dict[str, float]]:
    """Per dataset and level: the median round by output tok/s (its other figures with it)."""
    return {key: sorted((run[key] for run in runs), key=lambda r: r["output_tok_s"])[len(runs) // 2]
            for key in runs[0]}


def served_model(model: str | None, copy_model: bool) -> str | None:
    """The executor's --model: the given directory, the cached copy model (built on first use), or None."""
    if model is not None and copy_model:
        raise SystemExit("--model and --copy-model are exclusive")
    if copy_model:
        from executor_service.default_model.training import ensure_copy_model  # needs transformers (dev extra)

        return str(ensure_copy_model())
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests-per-level", type=int, default=1)
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests at every level")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--datasets", nargs="+", default=["copy", "free"], choices=["copy", "free"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--scheduler-flags", default="", help="more flags for both schedulers, e.g. --no-async-scheduling")
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft-model", default=str(DEFAULT_MODEL), help="--method draft_model: the executor's draft model")
    p.add_argument("--model", default=None, help="the executor's model directory (default: the embedded model)")
    p.add_argument("--copy-model", action="store_true",
                   help="serve the default model fine-tuned to copy (built and cached on first use)")
    p.add_argument("--stop-at-eos", action="store_true", help="answers end at the model's EOS (default: ignore it)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative-config.disable_by_batch_size (default: the scheduler's)")
    args = p.parse_args()
    work = {(name, level): dataset(name, max(args.min_requests, level * args.requests_per_level), args.output_len)
            for name in args.datasets for level in args.concurrency}
    config: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = args.disable_by_batch_size
    executor_args = ["--device", args.device, "--num-gpu-blocks", "4096"]
    model = served_model(args.model, args.copy_model)
    if model is not None:
        executor_args += ["--model", model]
    if args.method == "draft_model":
        config["model"] = args.draft_model
        executor_args += ["--draft-model", args.draft_model]
    spec = json.dumps(config)
    with service("executor_service", executor_args, args.log_dir, env={"OMP_NUM_THREADS": str(args.threads)},
                 name="executor") as executor:
        extra = args.scheduler_flags.split()
        rounds: dict[str | None, list[dict[tuple[str, int], dict[str, float]]]] = {None: [], spec: []}
        for r in range(args.rounds):
            for setting in ((None, spec) if r % 2 == 0 else (spec, None)):
                rounds[setting].append(run_setting(executor, setting, work, args.log_dir, extra, args.stop_at_eos))
    plain, spec_on = medians(rounds[None]), medians(rounds[spec])
    record: dict[str, Any] = {"benchmark": "speculative", "spec": spec, "model": model or str(DEFAULT_MODEL),
                              "output_len": args.output_len, "stop_at_eos": args.stop_at_eos, "rounds": args.rounds,
                              "scheduler_flags": args.scheduler_flags, "machine": machine(), "results": []}
    for key in work:
        on, off = spec_on[key], plain[key]
        drafted = on["num_draft_tokens"]
        row = {"dataset": key[0], "concurrency": key[1], "spec_tok_s": on["output_tok_s"],
               "plain_tok_s": off["output_tok_s"], "ratio": round(on["output_tok_s"] / off["output_tok_s"], 2),
               "spec_cpu_tok_s": on["cpu_tok_s"], "plain_cpu_tok_s": off["cpu_tok_s"],
               "cpu_ratio": round(on["cpu_tok_s"] / off["cpu_tok_s"], 2) if off["cpu_tok_s"] else None,
               "busy_ratio": round(on["busy_tok_s"] / off["busy_tok_s"], 2) if off["busy_tok_s"] else None,
               "spec_tokens_per_step": on["tokens_per_step"], "plain_tokens_per_step": off["tokens_per_step"],
               "acceptance": round(on["num_accepted_tokens"] / drafted, 3) if drafted else None,
               "mean_accepted_length": round(1 + on["num_accepted_tokens"] / on["num_drafts"], 2)
               if on["num_drafts"] else None}
        record["results"].append(row)
        print(f"{key[0]:>5} c={key[1]:<3} spec {on['output_tok_s']:8.1f} tok/s  plain {off['output_tok_s']:8.1f} "
              f"tok/s  ratio {row['ratio']:.2f}  (per CPU second {row['cpu_ratio']}, per executor-busy second "
              f"{row['busy_ratio']}; tokens per step {on['tokens_per_step']} vs {off['tokens_per_step']})  "
              f"acceptance {row['acceptance']}  mean accepted length {row['mean_accepted_length']}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
