"""Tools: schemas from signatures, the Hermes parser, execution that never raises."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout_service.errors import InvalidArgument
from rollout_service.generation.tools import (
    ToolCall,
    ToolRegistry,
    UnreadableCall,
    calculator,
    format_result,
    parse_hermes,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def registry():
    registry = ToolRegistry()
    yield registry
    registry.close()


def test_builtin_tools_have_schemas_from_signature_and_docstring(registry: ToolRegistry) -> None:
    assert {"add", "multiply", "calculator"} <= set(registry.names())
    schema = registry.toolset(["add"], "hermes", 1.0).schemas()[0]
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "add" and function["description"] == "Add two numbers."
    assert function["parameters"]["properties"]["a"] == {"type": "number", "description": "The first number."}
    assert function["parameters"]["required"] == ["a", "b"]


def test_a_tool_without_a_documented_signature_is_refused_at_registration(registry: ToolRegistry) -> None:
    def undocumented(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(Exception, match=r"docstring|type hint"):
        registry.register(undocumented)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', [ToolCall("add", {"a": 1})]),
        ('x <tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', [ToolCall("f", {"q": 1})]),
        ('<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>', [
            ToolCall("f", {}), ToolCall("g", {}),
        ]),
        ("no call here", []),
    ],
)  # fmt: skip
def test_hermes_parser_reads_calls(text: str, expected: list[ToolCall]) -> None:
    assert parse_hermes(text) == expected


@pytest.mark.parametrize(
    ("text", "reason", "name"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON", "add"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object", ""),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object", "add"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "not valid JSON", "add"),  # truncated turn
    ],
)
def test_hermes_parser_reports_unreadable_calls(text: str, reason: str, name: str) -> None:
    [call] = parse_hermes(text)
    assert isinstance(call, UnreadableCall)
    assert reason in call.reason and call.name == name


async def test_execution_outcomes_are_tool_messages(registry: ToolRegistry) -> None:
    release = threading.Event()

    def explode(x: int) -> int:
        """Raises.

        Args:
            x: Ignored.
        """
        raise ValueError("no")

    def block(x: int) -> int:
        """Blocks a worker thread.

        Args:
            x: Returned.
        """
        release.wait(30)
        return x

    async def wait_forever(x: int) -> int:
        """Never returns.

        Args:
            x: Ignored.
        """
        await asyncio.Event().wait()
        return x

    async def double(x: int) -> dict[str, int]:
        """Doubles, asynchronously.

        Args:
            x: The number.
        """
        return {"value": 2 * x}

    for function in (explode, block, wait_forever, double):
        registry.register(function)
    tools = registry.toolset(["add", "explode", "block", "wait_forever", "double"], "hermes", 0.2)
    calls = [
        ToolCall("add", {"a": 2, "b": 3.5}),
        ToolCall("double", {"x": 4}),
        ToolCall("nope", {}),
        UnreadableCall("{", "the tool call is not valid JSON (x)", "add"),
        ToolCall("add", {"a": 1}),
        ToolCall("explode", {"x": 1}),
        ToolCall("block", {"x": 1}),
        ToolCall("wait_forever", {"x": 1}),
    ]
    try:
        results = await tools.execute_all(calls)
    finally:
        release.set()
    assert [r.error_kind for r in results] == [
        None, None, "unknown_tool", "bad_json", "bad_arguments", "error", "timeout", "timeout",
    ]  # fmt: skip
    assert [r.content for r in results[:2]] == ["5.5", '{"value": 8}']
    assert results[2].content == "Error: unknown tool 'nope'; available: add, explode, block, wait_forever, double"
    assert "missing a required argument: 'b'" in results[4].content
    assert results[5].content == "Error: explode raised ValueError: no"
    assert results[6].content == "Error: block took longer than 0.2s"
    assert all(r.seconds < 5 for r in results)  # the timeouts ran concurrently, not in sequence
    assert results[0].message() == {"role": "tool", "name": "add", "content": "5.5"}


def test_unknown_names_are_invalid_arguments_listing_what_exists(registry: ToolRegistry) -> None:
    with pytest.raises(InvalidArgument, match=r"unknown tool 'search'; registered tools: add, calculator, multiply"):
        registry.toolset(["add", "search"], "hermes", 1.0)
    with pytest.raises(InvalidArgument, match=r"unknown tool parser 'mistral'; registered parsers: hermes, qwen"):
        registry.toolset(["add"], "mistral", 1.0)


async def test_a_registered_parser_is_used(registry: ToolRegistry) -> None:
    def bracket_parser(text: str):  # [[name a b]]
        return [ToolCall(n, {"a": float(a), "b": float(b)}) for n, a, b in (m.split() for m in text.split("[[")[1:])]

    registry.register_parser("bracket", bracket_parser)
    tools = registry.toolset(["multiply"], "bracket", 1.0)
    [result] = await tools.execute_all(tools.parser("sure [[multiply 6 7"))
    assert result.content == "42"


def test_calculator_evaluates_arithmetic_only() -> None:
    assert calculator("(2 + 3) * 4 - 10 / 4") == 17.5
    assert calculator("-2 ** 3 % 5") == 2
    for bad in ("__import__('os')", "a + 1", "2 ** 1000", "[1][0]"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_results_are_formatted_for_the_model() -> None:
    assert [format_result(v) for v in ("hi", 5, 5.0, 2.5, [1, "a"], None)] == [
        "hi",
        "5",
        "5",
        "2.5",
        '[1, "a"]',
        "null",
    ]


# The model's own output must not freeze the service: these held the GIL for minutes, built
# a 10 GB string, or raised outside the tools' error handling.
@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        ('{"name": "calculator", "arguments": {"expression": "((((9**64)**64)**64)**64)"}}', "more than 4096 bits"),
        ('{"name": "calculator", "arguments": {"expression": "((9**64)**64)**2"}}', "more than 4096 bits"),
        ('{"name": "multiply", "arguments": {"a": "a", "b": 10000000000}}', "a must be a number, got str"),
        ('{"name": "add", "arguments": {"a": true, "b": 1}}', "a must be a number, got bool"),
        ('{"name": "add", "arguments": {"a": ' + "1" * 5000 + ', "b": 1}}', "not valid JSON"),
    ],
)
async def test_hostile_tool_calls_fail_as_tool_errors_at_once(registry: ToolRegistry, call: str, fragment: str) -> None:
    [parsed] = parse_hermes(f"<tool_call>{call}</tool_call>")
    tools = registry.toolset(["add", "multiply", "calculator"], "hermes", 5.0)
    result = await asyncio.wait_for(tools.execute(parsed), 10)
    assert result.error_kind is not None
    assert fragment in result.content


def test_a_value_too_large_to_print_is_still_formatted() -> None:
    assert format_result(10**5000) == "<a int too large to print>"
    assert calculator("9 ** 64 * 9 ** 64") == 9**128  # large but bounded results still work
