"""Tools a model may call during an episode, and the parsers that find its calls in its output.

A tool is a typed Python callable with a Google-style docstring; its JSON schema comes from
``transformers.utils.get_json_schema``, as the chat template renders it. Nothing a tool call
does may end an episode: every failure becomes a ``ToolResult`` with an error message for
the model. Sync tools run in the registry's own threads, so a hanging one cannot starve the
default executor (reward functions); past its timeout it is abandoned, not killed.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import inspect
import json
import math
import operator
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollout_service.errors import InvalidArgument, echo
from rollout_service.generation.user_code import call_user_function

ToolFunction = Callable[..., Any]
ToolErrorKind = Literal["unknown_tool", "bad_json", "bad_arguments", "error", "timeout"]
DEFAULT_TOOL_PARSER = "hermes"
DEFAULT_TOOL_TIMEOUT_S = 10.0
TOOL_THREADS = 32
"""Worker threads for sync tools, shared by every run of one registry."""


@dataclass(frozen=True)
class Tool:
    name: str
    function: ToolFunction
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class UnreadableCall:
    """A call the model attempted whose text the parser could not read."""

    raw: str
    reason: str
    name: str = ""


ParsedCall = ToolCall | UnreadableCall


class ToolCallParser(Protocol):
    """Finds the tool calls in one model turn's decoded text (special tokens kept)."""

    def __call__(self, text: str) -> list[ParsedCall]: ...


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ParsedCall]:
    """Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (``arguments`` may be a JSON string); an unclosed call is read to the end of the turn."""
    return [_read_call_json(match.group(1).strip()) for match in _HERMES_CALL.finditer(text)]


def _read_call_json(raw: str) -> ParsedCall:
    try:
        payload = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, and an integer literal over Python's 4300 digits
        name = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
        return UnreadableCall(raw, f"the tool call is not valid JSON ({exc})", name.group(1) if name else "")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return UnreadableCall(raw, 'a tool call must be a JSON object {"name": <string>, "arguments": <object>}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return UnreadableCall(raw, f"the tool call's arguments are not valid JSON ({exc})", payload["name"])
    if not isinstance(arguments, dict):
        return UnreadableCall(raw, "the tool call's arguments must be a JSON object", payload["name"])
    return ToolCall(payload["name"], arguments)


BUILTIN_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "qwen": parse_hermes}


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: what the model is told, and for metrics how it went."""

    name: str
    content: str
    error_kind: ToolErrorKind | None
    seconds: float

    def message(self) -> dict[str, str]:
        return {"role": "tool", "name": self.name, "content": self.content}


# The built-in tools bound every operation before it runs: one huge integer power holds the GIL for minutes.
MAX_RESULT_BITS = 4096


def _number(name: str, value: Any) -> float:
    """Only real numbers go in (``"a" * 10**10`` is 10 GB)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    return value


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return _checked(operator.add, _number("a", a), _number("b", b))


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return _checked(operator.mul, _number("a", a), _number("b", b))


def _checked(op: Callable[..., float], left: float, right: float) -> float:
    """Apply ``op`` after checking its integer result cannot exceed MAX_RESULT_BITS."""
    if isinstance(left, int) and isinstance(right, int):
        bits = max(left.bit_length(), right.bit_length())
        if op is operator.mul:
            bits = left.bit_length() + right.bit_length()
        elif op is operator.pow:
            bits = left.bit_length() * max(right, 0)
        if bits > MAX_RESULT_BITS:
            raise ValueError(f"the result would have more than {MAX_RESULT_BITS} bits")
    try:
        return op(left, right)
    except OverflowError:
        raise ValueError("the result is too large for a float") from None


_OPERATORS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> float:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "(2 + 3) * 4".
    """

    def evaluate(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = evaluate(node.left), evaluate(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _checked(_OPERATORS[type(node.op)], left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.operand))
        raise ValueError(f"unsupported expression element {ast.dump(node)[:40]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return evaluate(ast.parse(expression, mode="eval").body)


BUILTIN_TOOLS: dict[str, ToolFunction] = {"add": add, "multiply": multiply, "calculator": calculator}


MAX_RESULT_CHARS = 16_384
"""What a non-string tool result may add to the conversation."""


def format_result(value: Any) -> str:
    """What the model reads: strings as they are, integral floats without '.0', the rest as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    with contextlib.suppress(TypeError, ValueError):
        return json.dumps(value)
    try:
        return str(value)[:MAX_RESULT_CHARS]
    except ValueError:  # an int over Python's 4300-digit str limit
        return f"<a {type(value).__name__} too large to print>"


class ToolRegistry:
    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        self._parsers: dict[str, ToolCallParser] = dict(BUILTIN_PARSERS)
        self._executor: ThreadPoolExecutor | None = None
        for name, function in BUILTIN_TOOLS.items():
            self.register(function, name)

    def register(self, function: ToolFunction, name: str | None = None) -> None:
        """The schema comes from the signature and docstring: a bad tool fails here, not mid-episode."""
        from transformers.utils import get_json_schema

        if not callable(function):
            raise TypeError(f"tool {name or function!r} is not callable")
        schema = get_json_schema(function)
        if name is not None:
            schema["function"]["name"] = name
        tool_name = schema["function"]["name"]
        self._tools[tool_name] = Tool(tool_name, function, schema)

    def register_parser(self, name: str, parser: ToolCallParser) -> None:
        if not callable(parser):
            raise TypeError(f"tool parser {name!r} is not callable")
        self._parsers[name] = parser

    def load_module(self, module_path: str) -> None:
        """Add a user module's ``TOOL_FUNCTIONS = {name: fn}`` and ``TOOL_PARSERS = {name: parser}``."""
        module = importlib.import_module(module_path)
        functions = getattr(module, "TOOL_FUNCTIONS", {})
        parsers = getattr(module, "TOOL_PARSERS", {})
        if not isinstance(functions, dict) or not isinstance(parsers, dict) or not (functions or parsers):
            raise ValueError(f"module {module_path} has no TOOL_FUNCTIONS or TOOL_PARSERS dict of name -> callable")
        for name, function in functions.items():
            self.register(function, name)
        for name, parser in parsers.items():
            self.register_parser(name, parser)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def parser_names(self) -> list[str]:
        return sorted(self._parsers)

    def toolset(self, names: Sequence[str], parser: str, timeout_s: float) -> ToolSet:
        """The tools of one run; unknown names are the client's error and say what exists."""
        if unknown := [n for n in names if n not in self._tools]:
            raise InvalidArgument(f"unknown tool {echo(unknown[0])}; registered tools: {', '.join(self.names())}")
        if parser not in self._parsers:
            known = ", ".join(self.parser_names())
            raise InvalidArgument(f"unknown tool parser {echo(parser)}; registered parsers: {known}")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tool")
        return ToolSet([self._tools[n] for n in names], self._parsers[parser], timeout_s, self._executor)

    def close(self) -> None:
        """Stop the tool threads (hanging tools keep theirs until they return)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class ToolSet:
    """The tools one run offers the model: parse a turn, execute its calls, never raise."""

    def __init__(
        self, tools: Sequence[Tool], parser: ToolCallParser, timeout_s: float, executor: ThreadPoolExecutor | None
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.parser = parser
        self.timeout_s = timeout_s
        self._executor = executor

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def execute_all(self, calls: Sequence[ParsedCall]) -> list[ToolResult]:
        """Run one turn's calls concurrently; results in call order."""
        return list(await asyncio.gather(*(self.execute(c) for c in calls)))

    async def execute(self, call: ParsedCall) -> ToolResult:
        start = time.perf_counter()
        if isinstance(call, UnreadableCall):
            return self._failed(call.name or "invalid", "bad_json", call.reason, start)
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return self._failed(call.name, "unknown_tool", f"unknown tool {call.name!r}; available: {available}", start)
        try:
            inspect.signature(tool.function).bind(**call.arguments)
        except TypeError as exc:
            return self._failed(call.name, "bad_arguments", f"bad arguments for {call.name}: {exc}", start)
        try:
            invoking = call_user_function(tool.function, self._executor, **call.arguments)
            value = await asyncio.wait_for(invoking, self.timeout_s)
        except TimeoutError:
            return self._failed(call.name, "timeout", f"{call.name} took longer than {self.timeout_s:g}s", start)
        except Exception as exc:
            return self._failed(call.name, "error", f"{call.name} raised {type(exc).__name__}: {exc}", start)
        return ToolResult(call.name, format_result(value), None, time.perf_counter() - start)

    @staticmethod
    def _failed(name: str, kind: ToolErrorKind, message: str, start: float) -> ToolResult:
        return ToolResult(name, f"Error: {message}", kind, time.perf_counter() - start)
