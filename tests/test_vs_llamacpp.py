"""benchmarks/vs_llamacpp.py skips cleanly where no llama-server can be had (#29): one JSON line saying why, exit 0,
no model made and nothing started."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import vs_llamacpp


def test_it_skips_with_a_reason_when_there_is_no_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PAGEDSERVE_LLAMACPP_DIR", str(tmp_path / "llama.cpp"))  # no cached build there
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None)  # no llama-server on PATH either
    vs_llamacpp.main(["--no-build", "--model-dir", str(tmp_path / "model")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "vs_llamacpp" and "no llama-server" in out["skipped"]
    assert not (tmp_path / "model").exists()


def test_cpu_seconds_counts_the_work_a_process_did() -> None:
    before = vs_llamacpp.cpu_seconds(os.getpid())
    spent = time.process_time()
    while time.process_time() - spent < 0.3:  # burn 0.3 s of this process's CPU
        sum(range(1000))
    assert vs_llamacpp.cpu_seconds(os.getpid()) - before >= 0.25


def test_cpu_per_1k_tokens_divides_each_process_by_the_tokens() -> None:
    per_1k = vs_llamacpp.cpu_per_1k({"executor": 1.0, "client": 0.5}, {"executor": 5.0, "client": 0.7}, 2000)
    assert per_1k == {"executor": 2.0, "client": 0.1}


def test_dedicated_adds_a_run_with_the_documented_server_only_settings() -> None:
    configs = vs_llamacpp.pagedserve_configs(("--x",), (), dedicated=True)
    assert configs["pagedserve"] == vs_llamacpp.Config(("--x",), ())
    assert configs["pagedserve dedicated"] == vs_llamacpp.Config(("--x", "--cpu-omp-wait-policy", "active"),
                                                                 ("--cpu-nice", "10"))
    assert list(vs_llamacpp.pagedserve_configs((), (), dedicated=False)) == ["pagedserve"]


def test_each_variant_adds_a_run_with_its_executor_flags_and_a_malformed_one_is_refused() -> None:
    configs = vs_llamacpp.pagedserve_configs(("--x",), ("--y",), dedicated=False,
                                             variants=["spin=--cpu-omp-spin-count 50000", "active=--a b"])
    assert configs["pagedserve spin"] == vs_llamacpp.Config(("--x", "--cpu-omp-spin-count", "50000"), ("--y",))
    assert configs["pagedserve active"] == vs_llamacpp.Config(("--x", "--a", "b"), ("--y",))
    for bad in ("no equals sign", "=--flag"):
        with pytest.raises(SystemExit, match="--variant"):
            vs_llamacpp.pagedserve_configs((), (), dedicated=False, variants=[bad])


def test_a_baseline_tree_adds_a_run_of_that_trees_whole_stack_and_a_tree_without_both_is_refused(
        tmp_path: Path) -> None:
    for package in ("executor_service", "scheduler_service"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__main__.py").write_text("")
    configs = vs_llamacpp.pagedserve_configs(("--x",), ("--y",), dedicated=False, baseline_tree=tmp_path)
    assert configs["pagedserve"].tree == vs_llamacpp.ROOT
    assert configs["pagedserve baseline"] == vs_llamacpp.Config(("--x",), ("--y",), tmp_path.resolve())
    (tmp_path / "scheduler_service" / "__main__.py").unlink()  # an executor alone is not a whole stack
    for tree in (tmp_path, tmp_path / "nothing"):
        with pytest.raises(SystemExit, match="--baseline-tree"):
            vs_llamacpp.pagedserve_configs((), (), dedicated=False, baseline_tree=tree)


def test_each_scheduler_variant_adds_a_run_with_its_scheduler_flags_and_a_malformed_one_is_refused() -> None:
    configs = vs_llamacpp.pagedserve_configs(("--x",), ("--y",), dedicated=False,
                                             scheduler_variants=["core1=--cpu-cores 1"])
    assert configs["pagedserve core1"] == vs_llamacpp.Config(("--x",), ("--y", "--cpu-cores", "1"))
    with pytest.raises(SystemExit, match="--scheduler-variant"):
        vs_llamacpp.pagedserve_configs((), (), dedicated=False, scheduler_variants=["no equals sign"])


def test_the_background_packings_measured_choice_counts_as_calibrated(tmp_path: Path) -> None:
    log = tmp_path / "executor.log"
    log.write_text("linear weights to be packed after ready for onednn; skinny kernel up to 0 rows (provisional: "
                   "measuring in the background after ready)\n")
    assert not vs_llamacpp.wait_calibrated(log, timeout=0.0)
    log.write_text(log.read_text() + "linear weights packed for onednn after ready, in the background (2.13 s): "
                   "skinny kernel up to 4 rows (measured; kept for the next start)\n")
    assert vs_llamacpp.wait_calibrated(log, timeout=5.0)


def test_a_measured_choice_the_cache_could_not_keep_counts_as_calibrated(tmp_path: Path) -> None:
    log = tmp_path / "executor.log"
    log.write_text("linear weights to be packed after ready for onednn; skinny kernel up to 0 rows (provisional: "
                   "measuring in the background after ready)\n"
                   "linear weights packed for onednn after ready, in the background (2.13 s): skinny kernel up to 4 "
                   "rows (measured; not kept: start-up cache /c/packing.json not written: Read-only file system)\n")
    assert vs_llamacpp.wait_calibrated(log, timeout=5.0)


def test_the_greedy_check_runs_each_distinct_executor_configuration_once(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults and an executor variant (--kv-cache-dtype float16) are each checked against llama.cpp's texts; a
    scheduler variant, with the defaults' executor flags, is not checked again."""
    started: list[tuple[str, ...]] = []

    @contextlib.contextmanager
    def pagedserve(model: Path, threads: int, extra: tuple[str, ...] = (), scheduler_extra: tuple[str, ...] = (),
                   tree: Path = vs_llamacpp.ROOT) -> Iterator[tuple[str, dict[str, int]]]:
        started.append(extra)
        yield "pagedserve " + " ".join(extra), {}

    @contextlib.contextmanager
    def llama_server(*args: object) -> Iterator[tuple[str, dict[str, int]]]:
        yield "llama.cpp", {}

    async def greedy_texts(url: str, reqs: list[object]) -> list[str]:
        return ["same", "other"] if url.endswith("float16") else ["same", "same"]

    monkeypatch.setattr(vs_llamacpp, "pagedserve", pagedserve)
    monkeypatch.setattr(vs_llamacpp, "llama_server", llama_server)
    monkeypatch.setattr(vs_llamacpp, "greedy_texts", greedy_texts)
    configs = vs_llamacpp.pagedserve_configs((), (), False, ["f16kv=--kv-cache-dtype float16"], None,
                                             ["nice=--cpu-nice 10"])
    greedy = vs_llamacpp.check_greedy(Path("model"), Path("server"), Path("gguf"), [], tmp_path, configs)
    assert greedy == {"prompts": 0, "equal": {"pagedserve": 2, "pagedserve f16kv": 1}}
    assert started == [(), ("--kv-cache-dtype", "float16")]
