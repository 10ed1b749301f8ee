"""`python -m client bench`: metrics on known timings, dataset loaders, arrivals, and an end-to-end run."""

from __future__ import annotations

import argparse
import io
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.bench.cli import add_bench_parser, load_requests
from client.bench.datasets import (
    BenchRequest,
    DatasetError,
    SyntheticConfig,
    json_schema_requests,
    load_file,
    synthetic_requests,
    tokenizer_counter,
)
from client.bench.progress import TextBar
from client.bench.report import format_table, result_dict
from client.bench.runner import RunConfig, RunResult, arrival_offsets
from client.bench.spec_decode import MetricsError, SpecCounters, format_spec_table, parse_spec_counters, spec_summary
from client.bench.stats import (
    SLO,
    RequestTrace,
    compute_metrics,
    distribution,
    itls,
    meets_slo,
    parse_goodput,
    percentile_label,
    tpot,
    ttft,
)
from tests.support.procs import ROOT, Stack, running_stack

# Three successful requests with hand-picked timings, and one failure that must not count.
A = RequestTrace(prompt_len=10, start=0.0, end=0.30, chunk_times=(0.10, 0.15, 0.25, 0.30), output_len=4)
B = RequestTrace(prompt_len=20, start=1.0, end=1.6, chunk_times=(1.2, 1.5), output_len=3)  # 2 tokens, then 1
C = RequestTrace(prompt_len=30, start=0.5, end=0.9, chunk_times=(0.9,), output_len=1)
FAILED = RequestTrace(prompt_len=40, start=0.0, end=0.05, success=False, error="INVALID_ARGUMENT: no")
TRACES = (A, B, C, FAILED)


def test_per_request_ttft_tpot_itl() -> None:
    assert [ttft(t) for t in (A, B, C)] == pytest.approx([0.1, 0.2, 0.4])
    assert tpot(A) == pytest.approx(0.2 / 3)      # (E2EL 0.3 - TTFT 0.1) / (4 - 1)
    assert tpot(B) == pytest.approx(0.2)          # (0.6 - 0.2) / (3 - 1): tokens, not chunks
    assert tpot(C) is None                        # one output token: no TPOT
    assert itls(A) == pytest.approx([0.05, 0.10, 0.05])
    assert itls(B) == pytest.approx([0.3])
    assert itls(C) == []


def test_aggregate_metrics_on_known_trace() -> None:
    m = compute_metrics(TRACES, duration=2.0, percentiles=(50, 99))
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 8)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    assert m.request_goodput is None
    # TTFT 100, 200, 400 ms: linear interpolation puts p99 at 200 + 0.98 * 200.
    assert (m.ttft.mean, m.ttft.median) == pytest.approx((700 / 3, 200.0))
    assert m.ttft.std == pytest.approx((140000 / 9) ** 0.5)   # population std: mean square deviation 140000/9
    assert m.ttft.percentiles == pytest.approx({50: 200.0, 99: 396.0})
    # TPOT only over outputs longer than one token.
    assert (m.tpot.mean, m.tpot.median) == pytest.approx((400 / 3, 400 / 3))
    # ITL pooled over requests: 50, 100, 50, 300 ms.
    assert (m.itl.mean, m.itl.median) == pytest.approx((125.0, 75.0))
    assert m.itl.percentiles[99] == pytest.approx(100 + 0.97 * 200)
    assert (m.e2el.mean, m.e2el.median) == pytest.approx((1300 / 3, 400.0))


@pytest.mark.parametrize(("slo", "goodput"), [
    (SLO(ttft=250), 1.0),               # A, B
    (SLO(tpot=100), 1.0),               # A, C (a one-token output counts as TPOT 0)
    (SLO(ttft=250, tpot=100), 0.5),     # A only
    (SLO(e2el=450), 1.0),               # A, C
    (SLO(ttft=50), 0.0),
])
def test_goodput_counts_requests_meeting_every_slo(slo: SLO, goodput: float) -> None:
    assert compute_metrics(TRACES, duration=2.0, slo=slo).request_goodput == pytest.approx(goodput)


def test_slo_boundary_is_inclusive() -> None:
    assert meets_slo(RequestTrace(prompt_len=1, start=0.0, end=0.5, chunk_times=(0.25,), output_len=1),
                     SLO(ttft=250, e2el=500))


def test_distribution_percentiles() -> None:
    d = distribution([k / 1000 for k in range(1, 101)], (50, 90, 99, 99.9))   # 1..100 ms
    assert (d.mean, d.median) == pytest.approx((50.5, 50.5))
    assert d.percentiles == pytest.approx({50: 50.5, 90: 90.1, 99: 99.01, 99.9: 99.901})
    empty = distribution([], (99,))
    assert (empty.mean, empty.median, empty.std, empty.percentiles) == (0.0, 0.0, 0.0, {99: 0.0})
    assert (percentile_label(99), percentile_label(99.9)) == ("p99", "p99.9")


def test_no_successes_gives_zeros() -> None:
    m = compute_metrics([FAILED], duration=1.0)
    assert (m.completed, m.failed, m.request_throughput, m.ttft.mean) == (0, 1, 0.0, 0.0)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == SLO(ttft=500, tpot=50.5, e2el=2000)
    for bad in (["foo:1"], ["ttft"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_table_and_json_use_vllm_names() -> None:
    result = RunResult(config=RunConfig(request_rate=4.0, max_concurrency=2), traces=TRACES, duration=2.0)
    m = compute_metrics(TRACES, 2.0, (99,), SLO(ttft=250))
    table = format_table(result, m)
    for line in ("Successful requests:", "Request goodput (req/s):", "Mean TTFT (ms):", "P99 ITL (ms):",
                 "Median E2EL (ms):", "Maximum request concurrency:"):
        assert line in table
    d = result_dict(result, m)
    assert (d["completed"], d["failed"], d["request_rate"], d["errors"]) == (3, 1, 4.0, [FAILED.error])
    assert d["p99_ttft_ms"] == pytest.approx(396.0)
    assert d["output_lens"] == [4, 3, 1]
    json.dumps(d)


def test_arrivals_poisson_and_gamma() -> None:
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    offsets = arrival_offsets(4000, rate=10.0, burstiness=1.0, seed=3)
    assert offsets == arrival_offsets(4000, rate=10.0, burstiness=1.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)        # exponential: CV 1
    steady = np.diff(arrival_offsets(4000, rate=10.0, burstiness=4.0, seed=3))
    assert steady.mean() == pytest.approx(0.1, rel=0.05)
    assert steady.std() / steady.mean() == pytest.approx(0.5, rel=0.1)    # gamma(k): CV 1/sqrt(k)
    with pytest.raises(ValueError):
        arrival_offsets(3, rate=1.0, burstiness=0.0)


def test_synthetic_dataset_is_seeded_and_clipped() -> None:
    cfg = SyntheticConfig(num_prompts=2000, input_mean=200, output_mean=100, input_max=600, output_max=300,
                          vocab_size=256, seed=7)
    reqs = synthetic_requests(cfg)
    assert reqs == synthetic_requests(cfg)
    assert reqs != synthetic_requests(SyntheticConfig(num_prompts=2000, seed=8))
    assert all(1 <= r.prompt_len <= 600 and 1 <= r.max_tokens <= 300 for r in reqs)
    assert all(r.prompt_token_ids is not None and len(r.prompt_token_ids) == r.prompt_len for r in reqs)
    assert all(10 <= t < 256 for r in reqs for t in r.prompt_token_ids or ())
    assert 0.7 * 200 < np.mean([r.prompt_len for r in reqs]) < 1.1 * 200
    assert 0.7 * 100 < np.mean([r.max_tokens for r in reqs]) < 1.1 * 100


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_json_list_and_requests_object(tmp_path: Path) -> None:
    items = [{"prompt": "héllo", "max_tokens": 5}, {"prompt_token_ids": [1, 2, 3], "max_tokens": 2}]
    expected = [BenchRequest(prompt_len=6, max_tokens=5, prompt="héllo"),     # UTF-8 bytes
                BenchRequest(prompt_len=3, max_tokens=2, prompt_token_ids=(1, 2, 3))]
    assert load_file(write_json(tmp_path / "list.json", items)) == expected
    assert load_file(write_json(tmp_path / "obj.json", {"requests": items}), "json") == expected


@pytest.mark.parametrize(("item", "message"), [
    ({"prompt": "x"}, r"requests\[0\]\.max_tokens"),
    ({"prompt": "x", "prompt_token_ids": [1], "max_tokens": 1}, "exactly one"),
    ({"prompt_token_ids": [], "max_tokens": 1}, "prompt_token_ids"),
    ({"max_tokens": 1}, "exactly one"),
])
def test_json_request_errors_name_the_field(tmp_path: Path, item: dict[str, Any], message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        load_file(write_json(tmp_path / "bad.json", [item]))


def conversation(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_first_exchange_and_vllm_filters(tmp_path: Path) -> None:
    data = [
        conversation(("human", "a" * 10), ("gpt", "b" * 20), ("human", "ignored"), ("gpt", "ignored")),
        conversation(("human", "abc"), ("gpt", "b" * 20)),                 # prompt < 4: dropped
        conversation(("human", "a" * 10), ("gpt", "xyz")),                 # output < 4: dropped
        conversation(("human", "a" * 1025), ("gpt", "b" * 10)),            # prompt > 1024: dropped
        conversation(("human", "a" * 1024), ("gpt", "b" * 4)),             # kept
        conversation(("human", "a" * 1000), ("gpt", "b" * 1049)),          # total 2049: dropped
        conversation(("human", "a" * 1000), ("gpt", "b" * 1048)),          # total 2048: kept
        conversation(("gpt", "welcome"), ("human", "é" * 5), ("gpt", "ok ok")),  # first human turn; 10 bytes
        conversation(("human", "alone")),                                  # no reply: skipped
        {"id": "no conversations"},
    ]
    path = write_json(tmp_path / "sharegpt.json", data)
    got = [(r.prompt_len, r.max_tokens) for r in load_file(path, "sharegpt")]
    assert got == [(10, 20), (1024, 4), (1000, 1048), (10, 5)]
    assert load_file(path) == load_file(path, "sharegpt")                  # auto-detected
    assert load_file(path, "sharegpt")[0].prompt == "a" * 10


def test_sharegpt_with_a_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "one": 1, "two": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    count = tokenizer_counter(tmp_path)
    assert count("one two three four") == 4
    path = write_json(tmp_path / "s.json", [conversation(("human", "one two one two one"), ("gpt", "a b c d e f"))])
    assert [(r.prompt_len, r.max_tokens) for r in load_file(path, "sharegpt", count)] == [(5, 6)]
    with pytest.raises(DatasetError, match=r"tokenizer\.json"):
        tokenizer_counter(tmp_path / "missing")


def parse_bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_cli_defaults_and_file_datasets(tmp_path: Path) -> None:
    args = parse_bench_args()
    assert (args.request_rate, args.burstiness, args.temperature, args.percentiles) == ([math.inf], 1.0, 0.0, [99.0])
    assert len(load_requests(args)) == SyntheticConfig().num_prompts
    assert parse_bench_args("--request-rate", "1,2.5,inf").request_rate == [1.0, 2.5, math.inf]
    path = write_json(tmp_path / "r.json", {"requests": [{"prompt": "abcd", "max_tokens": 3}] * 5})
    assert len(load_requests(parse_bench_args("--dataset", str(path), "--num-prompts", "2"))) == 2
    assert len(load_requests(parse_bench_args("--dataset", str(path)))) == 5
    for bad in (["--request-rate", "0"], ["--request-rate", "x"], ["--percentiles", "101"], ["--seed", "-1"]):
        with pytest.raises(SystemExit):
            parse_bench_args(*bad)


def test_prefix_repetition_dataset_uses_vllms_parameters() -> None:
    args = parse_bench_args("--dataset", "prefix-repetition", "--num-prompts", "12",
                            "--prefix-repetition-prefix-len", "20", "--prefix-repetition-suffix-len", "5",
                            "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "7")
    reqs = load_requests(args)
    assert reqs == load_requests(args) and len(reqs) == 12
    assert all(r.prompt_len == 25 and r.max_tokens == 7 and len(r.prompt_token_ids or ()) == 25 for r in reqs)
    prefixes = {(r.prompt_token_ids or ())[:20] for r in reqs}
    assert len(prefixes) == 3
    assert len({(r.prompt_token_ids or ())[20:] for r in reqs}) == 12
    counts = [sum((r.prompt_token_ids or ())[:20] == p for r in reqs) for p in prefixes]
    assert counts == [4, 4, 4]


def test_text_progress_bar() -> None:
    out = io.StringIO()
    bar = TextBar(4, width=8, stream=out)
    bar.update(1)
    bar.update(3)
    bar.close()
    assert out.getvalue().rstrip().endswith("[########] 4/4")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("bench"), ["--simulated"]) as s:
        yield s


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_end_to_end_bench_writes_json_and_png(stack: Stack, tmp_path: Path) -> None:
    result_json, png = tmp_path / "result.json", tmp_path / "plot.png"
    proc = bench("--server", stack.address, "--dataset", "synthetic", "--num-prompts", "20", "--request-rate", "inf",
                 "--ignore-eos", "--goodput", "ttft:60000", "--result-json", str(result_json), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(result_json.read_text())
    assert (result["completed"], result["failed"]) == (20, 0)
    expected = synthetic_requests(SyntheticConfig(num_prompts=20, seed=0))   # the CLI's defaults
    assert result["output_lens"] == [r.max_tokens for r in expected]         # --ignore-eos: exact lengths
    assert result["input_lens"] == [r.prompt_len for r in expected]
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["mean_ttft_ms"] > 0 and result["p99_e2el_ms"] >= result["median_e2el_ms"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rate_sweep_gives_one_run_per_rate(stack: Stack, tmp_path: Path) -> None:
    result_json, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = bench("--server", stack.address, "--num-prompts", "8", "--request-rate", "100,inf", "--burstiness", "0.5",
                 "--max-concurrency", "4", "--disable-tqdm", "--result-json", str(result_json), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(result_json.read_text())["runs"]
    assert [(r["request_rate"], r["completed"], r["max_concurrency"]) for r in runs] == [(100.0, 8, 4), ("inf", 8, 4)]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_json_schema_dataset_gives_valid_distinct_schemas() -> None:
    import jsonschema

    requests = json_schema_requests(20, 64)
    schemas = {r.json_schema for r in requests}
    assert len(schemas) == 16 and all(r.max_tokens == 64 and r.prompt for r in requests)
    for text in schemas:
        jsonschema.Draft202012Validator.check_schema(json.loads(text or "null"))


def test_json_schema_bench_runs_constrained_requests(stack: Stack, tmp_path: Path) -> None:
    """#30: `bench --dataset json-schema` sends each request with its schema (the simulated executor applies masks)."""
    result_json = tmp_path / "json.json"
    proc = bench("--server", stack.address, "--dataset", "json-schema", "--num-prompts", "8", "--request-rate", "inf",
                 "--synthetic-output-max", "48", "--disable-tqdm", "--result-json", str(result_json))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(result_json.read_text())
    assert (result["completed"], result["failed"]) == (8, 0)


def spec_page(drafts: float, draft_tokens: float, accepted: float, per_pos: dict[int, float]) -> str:
    lines = ["# TYPE vllm:spec_decode_num_drafts counter",
             f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
             'vllm:spec_decode_num_drafts_created{model_name="m"} 1.7e9',
             "# TYPE vllm:spec_decode_num_draft_tokens counter",
             f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}',
             "# TYPE vllm:spec_decode_num_accepted_tokens counter",
             f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
             "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {n}'
              for i, n in per_pos.items()]
    return "\n".join(lines) + "\n"


def test_spec_decode_summary_uses_vllms_definitions() -> None:
    """#31: acceptance rate = accepted / draft tokens, acceptance length = 1 + accepted / drafts, per position
    accepted at that position / drafts; a page without the counters is an error naming the flag to set."""
    before = parse_spec_counters(spec_page(4, 16, 10, {0: 4, 1: 3, 3: 1}))
    after = parse_spec_counters(spec_page(10, 40, 25, {0: 9, 1: 7, 3: 4}))
    assert after == SpecCounters(10.0, 40.0, 25.0, (9.0, 7.0, 0.0, 4.0))
    summary = spec_summary(after.minus(before))   # 6 drafts, 24 draft tokens, 15 accepted
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(62.5)
    assert summary["spec_decode_acceptance_length"] == pytest.approx(3.5)
    assert summary["spec_decode_per_position_acceptance_rates"] == pytest.approx([500 / 6, 400 / 6, 0.0, 300 / 6])
    table = format_spec_table(summary)
    assert "Acceptance rate (%):" in table and "62.50" in table and "  Position 3:" in table
    with pytest.raises(MetricsError, match="--speculative-config"):
        parse_spec_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")


def test_speculative_bench_reports_the_servers_acceptance(tmp_path: Path) -> None:
    """#31: `bench --speculative` against a real torch executor behind a scheduler with n-gram speculation:
    the JSON and the table carry the acceptance of exactly this run's requests."""
    corpus = ROOT / "executor_service/default_model/data/generated_corpus.txt"
    found = [p.strip() for p in corpus.read_text(encoding="utf-8").split("\n\n")
             if 300 <= len(p.strip()) <= 600 and "User:" not in p][:4]
    data = tmp_path / "copy.json"
    data.write_text(json.dumps([{"prompt": p + "\n\n" + p[:len(p) // 3], "max_tokens": 24} for p in found]))
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8, "adaptive": false}'
    result_json = tmp_path / "spec.json"
    with running_stack(tmp_path, [], ["--speculative-config", spec]) as s:
        args = ("--server", s.address, "--dataset", str(data), "--ignore-eos", "--max-concurrency", "2",
                "--disable-tqdm", "--speculative", "--metrics-url", f"http://127.0.0.1:{s.metrics_port}/metrics")
        proc = bench(*args, "--result-json", str(result_json))
    assert proc.returncode == 0, proc.stderr
    assert "Speculative Decoding" in proc.stdout and "Acceptance length:" in proc.stdout
    result = json.loads(result_json.read_text())
    assert result["completed"] == 4 and result["spec_decode_num_drafts"] > 0
    drafted, accepted = result["spec_decode_draft_tokens"], result["spec_decode_accepted_tokens"]
    assert 0 < accepted <= drafted <= 3 * result["spec_decode_num_drafts"]
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / drafted)
    rates = result["spec_decode_per_position_acceptance_rates"]
    assert 1 <= len(rates) <= 3 and rates == sorted(rates, reverse=True)
    assert sum(rates) * result["spec_decode_num_drafts"] / 100 == pytest.approx(accepted)


def test_speculative_bench_without_a_metrics_endpoint_is_a_clear_error(stack: Stack) -> None:
    proc = bench("--server", stack.address, "--num-prompts", "2", "--speculative", "--metrics-url",
                 "http://127.0.0.1:1/metrics", "--disable-tqdm")
    assert proc.returncode == 2 and "--metrics-url http://127.0.0.1:1/metrics" in proc.stderr
