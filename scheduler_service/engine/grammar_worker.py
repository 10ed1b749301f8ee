"""The grammar compile process: `python -m scheduler_service.engine.grammar_worker`, started by the engine core
(grammar_child.py), compiles constraints for one tokenizer and answers each with the compiled grammar as xgrammar's
JSON. It lives in a process of its own so that a compile past its deadline, or one whose client left, can be
ended by killing it: xgrammar's compile cannot be interrupted in a thread.

Frames over stdin/stdout: a 4-byte big-endian length, then a msgpack message. The process answers Reply(True) once
xgrammar is imported (about 3 s: it imports torch), then one Reply per Order: after a Tokenizer, once its compiler
is built; after a Compile, the compiled JSON or why the constraint does not compile.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from typing import IO, TYPE_CHECKING

import msgspec

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.request import Constraint, ConstraintKind
from scheduler_service.structured import InvalidConstraint, clean_message, to_grammar

if TYPE_CHECKING:
    import xgrammar

HEADER = struct.Struct(">I")


class Tokenizer(msgspec.Struct, tag=True, array_like=True):
    """The executor's DescribeResponse, serialized: what the compiles that follow compile for."""

    describe: bytes


class Compile(msgspec.Struct, tag=True, array_like=True):
    kind: int
    spec: str


class Reply(msgspec.Struct, array_like=True):
    ok: bool
    text: str = ""  # the compiled grammar's JSON, or why it does not compile


Order = Tokenizer | Compile


def write_frame(out: IO[bytes], payload: bytes) -> None:
    out.write(HEADER.pack(len(payload)) + payload)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes | None:
    """The next frame's payload; None at the end of the stream (or a partial frame: the other side died)."""
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    size = HEADER.unpack(head)[0]
    payload = inp.read(size)
    return payload if len(payload) == size else None


def compiler_for(describe: executor_pb2.DescribeResponse) -> xgrammar.GrammarCompiler:
    import xgrammar

    from scheduler_service.engine.grammar_vocab import tokenizer_vocab

    vocab, kind = tokenizer_vocab(describe)
    info = xgrammar.TokenizerInfo(vocab, getattr(xgrammar.VocabType, kind), vocab_size=describe.vocab_size,
                                  stop_token_ids=list(describe.eos_token_ids))
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the engine core keeps the cache


def answer(order: Order, compiler: xgrammar.GrammarCompiler | None) -> tuple[Reply, xgrammar.GrammarCompiler | None]:
    if isinstance(order, Tokenizer):
        describe = executor_pb2.DescribeResponse()
        describe.ParseFromString(order.describe)
        return Reply(True), compiler_for(describe)
    if compiler is None:
        return Reply(False, "no tokenizer given before the compile"), None
    try:
        grammar = to_grammar(Constraint(ConstraintKind(order.kind), order.spec))
        return Reply(True, compiler.compile_grammar(grammar).serialize_json()), compiler
    except InvalidConstraint as e:
        return Reply(False, str(e)), compiler
    except (RuntimeError, ValueError) as e:
        return Reply(False, clean_message(str(e))), compiler


def exit_with(parent: int) -> None:
    """End this process once its engine core is gone (even mid-compile, which no closed pipe interrupts)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    threading.Thread(target=exit_with, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    import torch
    import xgrammar  # noqa: F401 - imported before the first Reply: start-up never counts against a deadline

    torch.set_num_threads(1)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Order)
    write_frame(out, encoder.encode(Reply(True)))
    compiler: xgrammar.GrammarCompiler | None = None
    while (frame := read_frame(inp)) is not None:
        reply, compiler = answer(decoder.decode(frame), compiler)
        write_frame(out, encoder.encode(reply))


if __name__ == "__main__":
    main()
