"""`env=calculator`: the model may write a tool call, `<calc>47*86</calc>`, and reads the result back.

A turn that ends with a call gets its value as the observation (`<calc>47*86</calc>` + `4042`) and the model goes
on; a turn without one is final, and the run's reward scores the whole response (model turns and results, as the
model reads it). Expressions are integers with + - * // ( ): anything else, or a result past 10**15, gives `?`.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from lit_rlvr.envs.base import StepOutput, TextEnv, score_of

CALL = re.compile(r"<calc>(.{0,64}?)</calc>\s*$", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
LIMIT = 10**15


def evaluate(expression: str) -> int:
    """The integer value of `expression` (+ - * // and parentheses over integers); ValueError otherwise."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            result = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = value(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ValueError("division by zero")
            result = _OPS[type(node.op)](value(node.left), right)
        else:
            raise ValueError(f"not an integer expression: {ast.unparse(node)!r}")
        if abs(result) > LIMIT:
            raise ValueError("too large")
        return result

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(str(err)) from None
    return value(tree.body)


class CalculatorEnv(TextEnv):
    """`env_config`: `reward` (the run's reward function: `fn(prompt, completion, answer)`)."""

    stop = ("</calc>",)
    defaults = {"max_turns": 4, "max_tokens": 160, "timeout_s": 10.0, "options": {"reward": None}}

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        self.reward_fn = self.env_config["reward"]
        self.response = ""  # the response so far, as the model reads it

    def step(self, action: str) -> StepOutput:
        self.turns += 1
        self.response += action
        call = CALL.search(action)
        if call is not None:
            try:
                result = str(evaluate(call.group(1)))
            except ValueError:
                result = "?"
            self.response += result
            return {"observations": result, "reward": 0.0, "done": False, "metadata": {"tool_call": True}}
        score, malformed = score_of(self.reward_fn(self.prompt, self.response, self.answer))
        return {"observations": "", "reward": score, "done": True, "metadata": {"malformed": malformed}}


def demonstration(expression: str, answer_mark: str = "Answer: ") -> list[tuple[str, bool]]:
    """A worked use of the tool for supervised warm-up, as (text, written by the model) segments: the call, its
    result (the observation, not trained on) and the marked answer."""
    result = str(evaluate(expression))
    return [(f"<calc>{expression}</calc>", True), (result, False), (f"\n{answer_mark}{result}", True)]
