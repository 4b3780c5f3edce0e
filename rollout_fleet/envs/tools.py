"""Tool calling: function schemas, the Hermes/Qwen tool-call format, a calculator, and a tool environment.

Format (Hermes, as Qwen2.5/Qwen3 and SmolLM2's ChatML templates render it)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*7"}}
    </tool_call>

and the result goes back as a ``tool`` turn, ``<tool_response>...</tool_response>`` inside a
user turn. :class:`ToolEnv` answers each tool call of a turn with its result (an observation,
masked out of the loss) and ends the episode at the first turn without a call, scoring its
final answer against the ground truth.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_fleet.envs.base import Environment, StepResult, Turn
from rollout_fleet.scorers import gsm8k_flexible

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolCallError(ValueError):
    """A ``<tool_call>`` block that is not ``{"name": str, "arguments": object}`` JSON."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` of ``text``, in order; a malformed one raises ToolCallError."""
    out = []
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            raise ToolCallError(f"tool call is not JSON ({e.msg} at {e.pos}): {m.group(1)[:200]!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError(f"tool call needs a string 'name', got {m.group(1)[:200]!r}")
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallError(f"tool call arguments are neither an object nor JSON: {args[:200]!r}") from None
        if not isinstance(args, dict):
            raise ToolCallError(f"tool call 'arguments' must be an object, got {type(args).__name__}")
        out.append(ToolCall(obj["name"], args))
    return out


def strip_tool_calls(text: str) -> str:
    return _CALL.sub("", text).strip()


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
    ast.Pow: operator.pow,
}


def calculator(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % ** and parentheses) without ``eval``; errors come back as text."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    if not isinstance(expression, str) or len(expression) > 200:
        return "error: expression must be a string of at most 200 characters"
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. '(12+7)*3'.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@dataclass(frozen=True, slots=True)
class Tool:
    schema: dict[str, Any]  # OpenAI function schema ({"type": "function", "function": {...}})
    fn: Callable[..., str]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


class ChatMLFormat:
    """How observations enter a ChatML conversation (Qwen, SmolLM2): after the assistant's
    ``<|im_end|>`` (sampled as its stop token), a user turn of tool responses, then a new
    assistant header."""

    end = "<|im_end|>"

    def tool_results(self, results: list[str], turn_text: str) -> str:
        head = "" if self.end in turn_text else self.end  # a turn cut by its length limit is closed here
        body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
        return f"{head}\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


class ToolEnv(Environment):
    """Answers tool calls until a turn has none; reward: that turn's final answer equals the ground truth
    (``scorers.gsm8k_flexible``: its last number). A malformed call is answered with its error (the model may retry)."""

    name = "tools"

    def __init__(self, tools: list[Tool], fmt: ChatMLFormat | None = None) -> None:
        self.tools = {t.name: t for t in tools}
        self.fmt = fmt or ChatMLFormat()
        self.truth = ""
        self.calls = 0

    async def reset(self, ground_truth: str, extra_info: dict[str, Any]) -> None:
        self.truth, self.calls = str(ground_truth).strip(), 0

    async def step(self, turn: Turn) -> StepResult:
        try:
            calls = parse_tool_calls(turn.text)
        except ToolCallError as e:
            return StepResult(observation=self.fmt.tool_results([f"error: {e}"], turn.text), info={"bad_call": str(e)})
        if not calls:
            reward = gsm8k_flexible(turn.text.split(self.fmt.end, 1)[0], self.truth)
            return StepResult(done=True, reward=float(reward), info={"calls": self.calls})
        results = []
        for c in calls:
            self.calls += 1
            tool = self.tools.get(c.name)
            if tool is None:
                results.append(f"error: no tool named {c.name!r} (tools: {sorted(self.tools)})")
                continue
            try:
                results.append(str(tool.fn(**c.arguments)))
            except TypeError as e:
                results.append(f"error: bad arguments for {c.name}: {e}")
        return StepResult(observation=self.fmt.tool_results(results, turn.text), info={"calls": self.calls})


def calculator_env() -> ToolEnv:
    return ToolEnv([Tool(CALCULATOR_SCHEMA, calculator)])
