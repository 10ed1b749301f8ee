"""`python -m client bench ...`: argument parsing and the run/sweep driver."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import grpc

from client.bench.datasets import (
    BenchRequest,
    DatasetError,
    PrefixRepetitionConfig,
    SyntheticConfig,
    TokenCounter,
    byte_counter,
    json_schema_requests,
    load_file,
    prefix_repetition_requests,
    synthetic_requests,
    take,
    tokenizer_counter,
)
from client.bench.openai_backend import OpenAIBenchClient
from client.bench.plot import PlotPoint, plot_results
from client.bench.report import format_table, rate_label, result_dict, write_json
from client.bench.runner import RunConfig, run_benchmark
from client.bench.spec_decode import MetricsError, format_spec_table, scrape_spec_counters, spec_summary
from client.bench.stats import SLO, BenchMetrics, compute_metrics, parse_goodput
from client.lib import PagedServeClient

SYNTHETIC = "synthetic"
PREFIX_REPETITION = "prefix-repetition"
JSON_SCHEMA = "json-schema"


def parse_rates(text: str) -> list[float]:
    """'inf' or '4' or '1,2,4,8' -> request rates (req/s); each must be > 0."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'inf', or a comma list of them: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0: {text!r}")
    return rates


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of percentiles: {text!r}") from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100]: {text!r}")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    d = SyntheticConfig()
    b = subparsers.add_parser("bench", help="serving benchmark (like `vllm bench serve`)",
                              description="Send a dataset at a request rate and report throughput and latency.")
    b.add_argument("--backend", choices=["pagedserve", "openai"], default="pagedserve",
                   help="pagedserve: the gRPC Generation API at --server; openai: /v1/completions at --base-url")
    b.add_argument("--server", default="127.0.0.1:50051", help="gRPC HOST:PORT (--backend pagedserve)")
    b.add_argument("--base-url", default="http://127.0.0.1:8080",
                   help="OpenAI-compatible server URL, with or without /v1 (--backend openai)")
    b.add_argument("--model", default=None, help="model name for --backend openai (default: the server's first)")
    b.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="API key for either backend (default: $PAGEDSERVE_API_KEY)")
    data = b.add_argument_group("dataset")
    data.add_argument("--dataset", default=SYNTHETIC,
                      help="'synthetic', 'prefix-repetition', 'json-schema' (each request constrained to one of 16 "
                           "generated JSON schemas, --synthetic-output-max tokens at most) or a JSON FILE")
    data.add_argument("--dataset-format", choices=["auto", "json", "sharegpt"], default="auto",
                      help="FILE layout: json (a list of requests or {'requests': [...]}), sharegpt, "
                           "or auto (sharegpt when entries have 'conversations')")
    data.add_argument("--tokenizer", default=None, metavar="DIR",
                      help="directory with tokenizer.json to count prompt/output tokens (default: UTF-8 bytes)")
    data.add_argument("--num-prompts", type=positive_int, default=None,
                      help=f"requests to send (default: {d.num_prompts} synthetic, every request of a FILE)")
    data.add_argument("--synthetic-input-mean", type=positive_float, default=d.input_mean,
                      help=f"mean synthetic prompt length in tokens (default {d.input_mean:g})")
    data.add_argument("--synthetic-output-mean", type=positive_float, default=d.output_mean,
                      help=f"mean synthetic max_tokens (default {d.output_mean:g})")
    data.add_argument("--synthetic-input-max", type=positive_int, default=d.input_max,
                      help=f"longest synthetic prompt in tokens (default {d.input_max})")
    data.add_argument("--synthetic-output-max", type=positive_int, default=d.output_max,
                      help=f"largest synthetic max_tokens (default {d.output_max})")
    data.add_argument("--synthetic-sigma", type=positive_float, default=d.sigma,
                      help="lognormal sigma of the synthetic lengths")
    data.add_argument("--synthetic-vocab-size", type=positive_int, default=d.vocab_size,
                      help=f"synthetic prompt token ids are drawn from [{d.min_token_id}, this)")
    r = PrefixRepetitionConfig()
    data.add_argument("--prefix-repetition-prefix-len", type=positive_int, default=r.prefix_len,
                      help="prefix-repetition: tokens in each shared prefix")
    data.add_argument("--prefix-repetition-suffix-len", type=positive_int, default=r.suffix_len,
                      help="prefix-repetition: tokens of each request's own suffix")
    data.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=r.num_prefixes,
                      help="prefix-repetition: distinct prefixes the requests share")
    data.add_argument("--prefix-repetition-output-len", type=positive_int, default=r.output_len,
                      help="prefix-repetition: max_tokens of every request")
    load = b.add_argument_group("load")
    load.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                      help="req/s; 'inf' sends all at once; a comma list (1,2,4,8) runs one full sweep per rate")
    load.add_argument("--burstiness", type=positive_float, default=1.0,
                      help="gamma shape of the inter-arrival times; 1 = Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--max-concurrency", type=positive_int, default=None,
                      help="at most this many requests in flight (default: no cap)")
    load.add_argument("--seed", type=non_negative_int, default=0,
                      help="seed of the synthetic dataset and the arrival times")
    load.add_argument("--ignore-eos", action="store_true", help="every request generates exactly max_tokens")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    load.add_argument("--output-len-hint", action="store_true",
                      help="send max_tokens as output_len_hint (for the scheduler's --policy sjf)")
    load.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds")
    out = b.add_argument_group("results")
    out.add_argument("--percentiles", "--metric-percentiles", type=parse_percentiles, default=[99.0],
                     help="comma list of latency percentiles to report (default 99)")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (requests meeting all, per second)")
    out.add_argument("--result-json", default=None, metavar="FILE",
                     help="write every run's configuration and metrics to FILE as JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="plot throughput and latency against request rate to FILE.png")
    out.add_argument("--disable-tqdm", "--no-progress", dest="progress", action="store_false",
                     help="no progress bar")
    spec = b.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", action="store_true",
                      help="report the server's speculative decoding during each run (acceptance rate, acceptance "
                      "length, per-position acceptance), from its Prometheus counters before and after the run")
    spec.add_argument("--metrics-url", default=None, metavar="URL",
                      help="the server's Prometheus endpoint for --speculative (default: http://HOST:8000/metrics "
                      "for --server HOST:PORT, BASE_URL/metrics for --backend openai)")
    return b


def metrics_url(args: argparse.Namespace) -> str:
    if args.metrics_url:
        return str(args.metrics_url)
    if args.backend == "openai":
        return str(args.base_url).rstrip("/") + "/metrics"
    return f"http://{str(args.server).rsplit(':', 1)[0]}:8000/metrics"


def token_counter(args: argparse.Namespace) -> TokenCounter:
    return tokenizer_counter(args.tokenizer) if args.tokenizer else byte_counter


def load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == SYNTHETIC:
        cfg = SyntheticConfig(
            num_prompts=args.num_prompts or SyntheticConfig().num_prompts, input_mean=args.synthetic_input_mean,
            output_mean=args.synthetic_output_mean, input_max=args.synthetic_input_max,
            output_max=args.synthetic_output_max, sigma=args.synthetic_sigma,
            vocab_size=args.synthetic_vocab_size, seed=args.seed)
        return synthetic_requests(cfg)
    if args.dataset == JSON_SCHEMA:
        return json_schema_requests(args.num_prompts or 100, args.synthetic_output_max)
    if args.dataset == PREFIX_REPETITION:
        return prefix_repetition_requests(PrefixRepetitionConfig(
            num_prompts=args.num_prompts or PrefixRepetitionConfig().num_prompts,
            prefix_len=args.prefix_repetition_prefix_len, suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes, output_len=args.prefix_repetition_output_len,
            vocab_size=args.synthetic_vocab_size, seed=args.seed))
    return take(load_file(args.dataset, args.dataset_format, token_counter(args)), args.num_prompts)


def run_config(args: argparse.Namespace, rate: float) -> RunConfig:
    return RunConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                     seed=args.seed, ignore_eos=args.ignore_eos, temperature=args.temperature,
                     output_len_hint=args.output_len_hint, timeout=args.timeout, show_progress=args.progress)


async def check_server(client: PagedServeClient, server: str) -> bool:
    try:
        if await client.health(timeout=10.0):
            return True
        print(f"error: {server} is not SERVING", file=sys.stderr)
    except grpc.aio.AioRpcError as e:
        print(f"error: {server} unreachable: {e.code().name}: {e.details()}", file=sys.stderr)
    return False


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    server = args.server if args.backend == "pagedserve" else args.base_url
    return {"backend": args.backend, "server": server, "dataset": args.dataset, "seed": args.seed,
            "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "percentiles": args.percentiles, "goodput": args.goodput}


def bench_client(args: argparse.Namespace) -> PagedServeClient | OpenAIBenchClient:
    if args.backend == "openai":
        return OpenAIBenchClient(args.base_url, args.api_key, args.model)
    return PagedServeClient(args.server, api_key=args.api_key)


async def run_bench(args: argparse.Namespace) -> int:
    try:
        slo = parse_goodput(args.goodput) if args.goodput else SLO()
        requests = load_requests(args)
    except (ValueError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("error: the dataset has no requests (after filtering)", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    points: list[PlotPoint] = []
    async with bench_client(args) as client:
        if not await (check_server(client, args.server) if isinstance(client, PagedServeClient) else client.check()):
            return 1
        for rate in args.request_rate:
            try:
                before = scrape_spec_counters(metrics_url(args)) if args.speculative else None
                result = await run_benchmark(client, requests, run_config(args, rate),
                                             desc=f"rate {rate_label(rate)}")
                spec = (spec_summary(scrape_spec_counters(metrics_url(args)).minus(before))
                        if before is not None else {})
            except MetricsError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            metrics: BenchMetrics = compute_metrics(result.traces, result.duration, args.percentiles, slo)
            print(format_table(result, metrics), flush=True)
            if spec:
                print(format_spec_table(spec), flush=True)
            runs.append(result_dict(result, metrics, {**run_meta(args), **spec}))
            points.append(PlotPoint(rate_label(rate), metrics))
    if args.result_json:
        write_json(args.result_json, runs)
    if args.plot:
        plot_results(points, args.plot)
    return 0 if all(p.metrics.completed for p in points) else 1
