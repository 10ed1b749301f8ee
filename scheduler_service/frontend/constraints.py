"""A request's structured-output constraint, checked before any work: the cheap checks (one kind, size, JSON)
on the event loop, the grammar itself (xgrammar parses it) on a worker thread of its own, for at most a budget.
Every refusal names the field."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from protos.pagedserve.v1 import common_pb2
from scheduler_service.core.request import Constraint, ConstraintKind
from scheduler_service.frontend.validation import InvalidArgument
from scheduler_service.structured import (
    FIELD_NAMES,
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    InvalidConstraint,
    json_schema_text,
    to_grammar,
)

log = logging.getLogger("pagedserve.frontend")
FIELD = "sampling.structured_outputs"
CHECK_BUDGET_S = 1.0
"""How long the api server's early grammar check may take (queueing included) before the constraint is passed on
unchecked: the engine core compiles every constraint anyway, in a process it kills past
--structured-outputs-compile-timeout, taking turns between callers. A schema of 3,000 optional properties with
minProperties 1,500 took xgrammar 35 s to parse; checked without a budget on the thread that also tokenized long
prompts, it held every long prompt and every constrained request of its api server that long."""
SLOW_REMEMBERED = 1024
"""Constraints (by hash) whose check ran past the budget, passed on at once when sent again: one slow spec sent
over and over does not keep the check thread busy (a hash collision only skips an early check)."""
MAX_SCHEMA_DEPTH = 72
"""JSON nesting a schema may have. The HTTP api's bodies are held to 64 levels (MAX_BODY_DEPTH); the gRPC api's
schema is text, and deeper ones recursed out of json.loads (an UNKNOWN status) or took xgrammar seconds to compile
(300 levels: ~9 s), holding up every later constrained request on the engine core's compile thread. 72: room for
the levels a required tool choice wraps around a parameters schema that the body limit let through."""


MAX_PATTERN_REPEATS = 512
"""How many times, in all, a JSON schema's regular expressions (pattern, patternProperties) may repeat a character
class or '.': a product of the repetition bounds around each, summed. xgrammar expands a schema's pattern
repetitions where its regex and grammar kinds do not (on the default model's 2k vocabulary `[a-z]{1,10000}` took
47 s to compile as a pattern and 0.08 s as a regex; `.{1,3000}` as propertyNames 18 s to check in the api server
and 17 s more to compile on the engine core's one compile thread). 512 allows `([a-z0-9-]{1,63}\\.){1,8}`."""
MAX_PATTERN_NESTING = 2
"""Bounded repetitions nested in a pattern: each level multiplies the ways to match, and the compile time with them
(`((.{1,8}){1,8}){1,8}`, 512 repeats three deep: 32 s; `(.{1,8}){1,64}`, two deep: 5 s)."""
CLASS_ESCAPES = frozenset("dDwWsSpP")


def constraint_from(p: common_pb2.SamplingParams) -> Constraint | None:
    """The constraint the request's sampling.structured_outputs states, None without one."""
    if not p.HasField("structured_outputs"):
        return None
    s = p.structured_outputs
    given = [k for k, on in ((ConstraintKind.JSON_SCHEMA, bool(s.json)), (ConstraintKind.JSON_OBJECT, s.json_object),
                             (ConstraintKind.REGEX, bool(s.regex)), (ConstraintKind.CHOICE, bool(s.choice)),
                             (ConstraintKind.GRAMMAR, bool(s.grammar))) if on]
    if len(given) != 1:
        names = ", ".join(FIELD_NAMES[k] for k in given) or "none"
        raise InvalidArgument(FIELD, f"set exactly one of json, json_object, regex, choice, grammar (got {names})")
    kind = given[0]
    field = f"{FIELD}.{FIELD_NAMES[kind]}"
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, checked_choices(list(s.choice), field))
    spec = s.json if kind is ConstraintKind.JSON_SCHEMA else s.regex if kind is ConstraintKind.REGEX else s.grammar
    check_size(spec, field)
    if kind is ConstraintKind.JSON_SCHEMA:
        spec = json_schema_text(parsed_schema(spec, field))
    return Constraint(kind, spec)


def check_size(text: str, field: str) -> None:
    size = len(text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(field, f"{size} bytes; at most {MAX_CONSTRAINT_BYTES} bytes")


def parsed_schema(text: str, field: str) -> object:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidArgument(field, f"nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as e:
        raise InvalidArgument(field, f"not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(field, f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    if depth_exceeds(schema, MAX_SCHEMA_DEPTH):
        raise InvalidArgument(field, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    check_patterns(schema_patterns(schema), field)
    unenforced = unenforced_keyword(schema)
    if unenforced is not None:
        raise InvalidArgument(field, f"{unenforced} is not supported: the grammar cannot enforce it, so outputs could "
                              "break it (xgrammar ignores it)")
    return schema


UNENFORCED = ("not", "if", "contains", "dependentRequired", "dependentSchemas", "dependencies")
"""Keywords xgrammar accepts and ignores: an output it allows can break them (tests/frontend/test_schema_keywords.py
shows each against xgrammar). vLLM refuses such schemas for xgrammar too; uniqueItems (when true) and allOf of more
than one schema, or beside other constraints, are checked in unenforced_keyword."""
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$id", "$schema", "$anchor"))
SCHEMA_VALUED = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                 "propertyNames", "then", "else", "allOf", "anyOf", "oneOf", "prefixItems")
SCHEMAS_BY_NAME = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keyword(schema: object) -> str | None:
    """Where a JSON schema first uses a keyword the grammar would ignore ("/properties/tags/uniqueItems"), or None.
    Only keywords are looked at: a property named "if" or "not" is a name, not a keyword."""
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        found = ignored_here(node)
        if found is not None:
            return f"{path}/{found}" if path else found
        for key in SCHEMA_VALUED:
            if key in node:
                stack.append((node[key], f"{path}/{key}"))
        for key in SCHEMAS_BY_NAME:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{path}/{key}/{name}") for name, sub in node[key].items())
    return None


def ignored_here(node: dict[str, object]) -> str | None:
    """The keyword of this schema object (not of its subschemas) that xgrammar would ignore, or None."""
    for key in UNENFORCED:
        if key in node and not (key.startswith("depend") and node[key] == {}):  # an empty map requires nothing
            return key
    if node.get("uniqueItems") is True:
        return "uniqueItems"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and (len(all_of) > 1 or set(node) - ANNOTATIONS - {"allOf"}):
        return "allOf"  # one schema alone is taken as that schema; more, or beside other keywords, are not merged
    return None


def check_patterns(patterns: list[str], field: str) -> None:
    """A schema's patterns within MAX_PATTERN_REPEATS and MAX_PATTERN_NESTING (InvalidArgument naming the field)."""
    measured = [pattern_repeats(p) for p in patterns]
    repeats = sum(count for count, _ in measured)
    if repeats > MAX_PATTERN_REPEATS:
        raise InvalidArgument(field, f"its patterns repeat character classes {repeats} times in all (the product of "
                              f"the repetition bounds around each, summed); at most {MAX_PATTERN_REPEATS}")
    for pattern, (_, depth) in zip(patterns, measured, strict=True):
        if depth > MAX_PATTERN_NESTING:
            raise InvalidArgument(field, f"pattern {pattern[:64]!r} nests bounded repetitions {depth} deep; at most "
                                  f"{MAX_PATTERN_NESTING}")


def schema_patterns(schema: object) -> list[str]:
    """Every regular expression of a JSON schema: the values of `pattern`, the keys of `patternProperties`."""
    found: list[str] = []
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                found.append(item["pattern"])
            if isinstance(item.get("patternProperties"), dict):
                found.extend(item["patternProperties"])
            stack.extend(item.values())
    return found


def pattern_repeats(pattern: str) -> tuple[int, int]:
    """The character classes and '.' of a regular expression, each counted as many times as the bounded
    repetitions around it allow (`{m,n}` counts n, `{m,}` m; `*`, `+` and `?` count once): what xgrammar expands;
    and how deep bounded repetitions of them nest."""
    groups = [[0, 0]]  # inside each open group: the count so far, the deepest nesting
    last, depth = 0, 0  # the count and nesting of the atom a quantifier would repeat
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "{" and (bound := repetition_bound(pattern, i)) is not None:
            groups[-1][0] += last * (bound[0] - 1)
            if last and bound[0] > 1:
                depth += 1
                groups[-1][1] = max(groups[-1][1], depth)
            last *= bound[0]
            i = bound[1]
            continue
        if c == "(":
            groups.append([0, 0])
            last, depth = 0, 0
            i += 3 if pattern.startswith("?:", i + 1) else 1
            continue
        if c == ")" and len(groups) > 1:
            last, depth = groups.pop()
            groups[-1][0] += last
            groups[-1][1] = max(groups[-1][1], depth)
            i += 1
            continue
        if c == "\\":
            last = 1 if pattern[i + 1:i + 2] in CLASS_ESCAPES else 0
            i += 1
        elif c == "[":
            last, i = 1, class_end(pattern, i)
        else:
            last = 1 if c == "." else 0
        depth = 0
        groups[-1][0] += last
        i += 1
    return sum(g[0] for g in groups), max(g[1] for g in groups)


def repetition_bound(pattern: str, start: int) -> tuple[int, int] | None:
    """At a `{`: the count a `{m}`, `{m,}`, `{,n}` or `{m,n}` quantifier repeats its atom (n, else m) and the index
    after it; None where the brace is a literal."""
    end = pattern.find("}", start)
    low, _, high = pattern[start + 1:end].partition(",") if end > 0 else ("", "", "")
    if not (low or high) or not all(part.isascii() and part.isdigit() for part in (low, high) if part):
        return None
    return max(int(low or 0), int(high or 0), 1), end + 1


def class_end(pattern: str, start: int) -> int:
    """The index of the `]` closing the character class opened at `start` (the end of the pattern if none)."""
    i = start + 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i


def depth_exceeds(value: object, limit: int) -> bool:
    """Whether a JSON value nests objects and arrays deeper than `limit` levels (without recursion)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def checked_choices(choices: list[str], field: str) -> str:
    if len(choices) > MAX_CHOICES:
        raise InvalidArgument(field, f"{len(choices)} choices; at most {MAX_CHOICES}")
    for i, c in enumerate(choices):
        if not c:
            raise InvalidArgument(f"{field}[{i}]", "a choice is a non-empty string")
    spec = json.dumps(choices, ensure_ascii=False)
    check_size(spec, field)
    return spec


class DaemonWorker:
    """Runs the calls submitted to it one at a time, in order, on a daemon thread: a call still running when the
    process exits does not hold the exit (a pool thread is joined at exit, and a costly schema's check kept an api
    server from exiting until xgrammar was done, ~20 s). A call cancelled before it starts is skipped."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller's to see
                future.set_exception(e)


def import_xgrammar() -> None:
    import xgrammar  # noqa: F401  (about 3 s, once: it imports torch)


class GrammarCheck:
    """The api server's early check that xgrammar can make a grammar of a constraint (an InvalidArgument naming
    the field if not), one at a time on a thread of its own, within CHECK_BUDGET_S (xgrammar's import, on the
    first check, is not counted). `build`: to_grammar."""

    def __init__(self, budget: float = CHECK_BUDGET_S, build: Callable[[Constraint], object] = to_grammar) -> None:
        self.budget = budget
        self._build = build
        self._worker = DaemonWorker("grammar-check")
        self._imported: asyncio.Future[None] | None = None
        self._slow: OrderedDict[int, None] = OrderedDict()

    async def check(self, constraint: Constraint) -> None:
        key = hash(constraint)
        if key in self._slow:
            return
        if self._imported is None:
            self._imported = asyncio.wrap_future(self._worker.submit(import_xgrammar))
        await asyncio.shield(self._imported)  # a client that leaves meanwhile does not cancel it for the rest
        building = asyncio.wrap_future(self._worker.submit(self._build, constraint))
        try:
            await asyncio.wait_for(building, self.budget)  # a check still queued is cancelled, not run
        except InvalidConstraint as e:
            raise InvalidArgument(f"{FIELD}.{FIELD_NAMES[constraint.kind]}", str(e)) from None
        except TimeoutError:
            self._remember_slow(key)
            log.info("a %s constraint's grammar check ran past %.1f s; passed on to the engine core's compile",
                     constraint.kind.name.lower(), self.budget)

    def _remember_slow(self, key: int) -> None:
        self._slow[key] = None
        if len(self._slow) > SLOW_REMEMBERED:
            self._slow.popitem(last=False)
