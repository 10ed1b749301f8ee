"""What compiling in the engine core's compile process costs per compile, against compiling in-process (the old
path): distinct small JSON schemas and regexes, on the default model's 2k vocabulary and on a 32k one, in
interleaved rounds. In-process: xgrammar parses and compiles on the calling thread. Process: CompileChild.compile
(order out, parse, compile, serialize to JSON, answer back) and the parent's deserialize_json. The process's
start-up (~3.5 s, once and after each kill) is measured apart.

    PYTHONPATH=. python -m benchmarks.grammar_process [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from typing import Any

from executor_service.default_model.model import train_tokenizer
from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.request import Constraint, ConstraintKind
from scheduler_service.engine.grammar_child import CompileChild
from scheduler_service.engine.grammar_vocab import tokenizer_vocab
from scheduler_service.structured import json_schema_text, to_grammar


def describes() -> dict[str, executor_pb2.DescribeResponse]:
    """The default model's tokenizer, and the same with 30k made-up byte-level tokens added (a 32k vocabulary)."""
    spec = json.loads(train_tokenizer().to_str())
    small = executor_pb2.DescribeResponse(vocab_size=2048, tokenizer_json=json.dumps(spec), eos_token_ids=[0])
    rng = random.Random(0)
    vocab = spec["model"]["vocab"]
    while len(vocab) < 32000:
        vocab.setdefault("".join(rng.choices(string.ascii_letters + "Ġ", k=rng.randint(2, 9))), len(vocab))
    big = executor_pb2.DescribeResponse(vocab_size=32000, tokenizer_json=json.dumps(spec), eos_token_ids=[0])
    return {"2k": small, "32k": big}


def constraints(round_: int) -> list[Constraint]:
    """Distinct specs each round (nothing cached anywhere): 4 small schemas, 2 regexes."""
    out = []
    for i in range(4):
        schema = {"type": "object", "properties": {f"f{round_}_{i}_{j}": {"type": t} for j, t in
                                                   enumerate(("string", "integer", "boolean")[:1 + i % 3])},
                  "required": [f"f{round_}_{i}_0"]}
        out.append(Constraint(ConstraintKind.JSON_SCHEMA, json_schema_text(schema)))
    out.append(Constraint(ConstraintKind.REGEX, f"[a-z]{{1,{20 + round_}}}@[a-z]{{1,10}}\\.(com|org)"))
    out.append(Constraint(ConstraintKind.REGEX, f"\\d{{3}}-\\d{{{4 + round_ % 3}}}"))
    return out


def in_process(compiler: object, constraint: Constraint) -> float:
    t = time.perf_counter()
    compiler.compile_grammar(to_grammar(constraint))  # type: ignore[attr-defined]
    return time.perf_counter() - t


def in_child(child: CompileChild, describe: executor_pb2.DescribeResponse, info: Any, constraint: Constraint
             ) -> float:
    import xgrammar

    t = time.perf_counter()
    reply = child.compile(describe, constraint)
    xgrammar.CompiledGrammar.deserialize_json(reply.text, info)
    return time.perf_counter() - t


def main() -> None:
    import xgrammar

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for label, describe in describes().items():
        vocab, kind = tokenizer_vocab(describe)
        info = xgrammar.TokenizerInfo(vocab, getattr(xgrammar.VocabType, kind), vocab_size=describe.vocab_size,
                                      stop_token_ids=list(describe.eos_token_ids))
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        child = CompileChild(600.0)
        t = time.perf_counter()
        child.compile(describe, Constraint(ConstraintKind.JSON_OBJECT, ""))
        print(f"{label}: compile process start + tokenizer set-up {time.perf_counter() - t:.2f} s")
        local: list[float] = []
        remote: list[float] = []
        for r in range(args.rounds):
            for c in constraints(r + 100 * (label == "32k")):
                if r % 2:  # interleaved, alternating which goes first
                    local.append(in_process(compiler, c))
                    remote.append(in_child(child, describe, info, c))
                else:
                    remote.append(in_child(child, describe, info, c))
                    local.append(in_process(compiler, c))
        child.close()
        lm, rm = statistics.median(local), statistics.median(remote)
        print(f"{label}: per compile, median of {len(local)}: in-process {lm * 1e3:.2f} ms, compile process "
              f"{rm * 1e3:.2f} ms ({rm / lm:.2f}x, +{(rm - lm) * 1e3:.2f} ms); max {max(local) * 1e3:.1f} / "
              f"{max(remote) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
