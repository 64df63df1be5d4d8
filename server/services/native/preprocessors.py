"""twinkle.preprocessor's row preprocessors, reimplemented in the gateway for server-held datasets' `map`.

Each takes one row (a dict) and returns the columns it sets, exactly as twinkle-kit 0.5.1's class of the same name
does (`SelfCognitionProcessor`, `AlpacaProcessor`, `CompetitionMathProcessor`, `GSM8KProcessor`); like datasets.map,
the dataset keeps the row's other columns. No client code runs: the name picks one of these functions and its
`init_args` are validated by api_schemas/native/datasets.py's PREPROCESSORS. A row without the columns a
preprocessor reads is a PreprocessError naming the row and the column.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from api_schemas.native.datasets import Args, GSM8KArgs, SelfCognitionArgs

Row = dict[str, Any]
Fn = Callable[[Row], Row]

GSM8K_SYSTEM = ("You are a helpful math assistant. Solve the problem step by step "
                "and put your final answer within \\boxed{}.")


class PreprocessError(ValueError):
    pass


def _text(row: Row, column: str, name: str) -> str:
    if column not in row:
        raise PreprocessError(f"{name} reads the column {column!r}, which this row does not have "
                              f"(columns: {sorted(row)})")
    value = row[column]
    if not isinstance(value, str):
        raise PreprocessError(f"{name}: column {column!r} must hold text")
    return value


def self_cognition(args: SelfCognitionArgs) -> Fn:
    name = args.model_name or "twinkle robot"
    author = args.model_author or "twinkle lab"

    def fill(text: str) -> str:
        return text.replace("{{NAME}}", name).replace("{{AUTHOR}}", author)

    def fn(row: Row) -> Row:
        query = fill(_text(row, "query", "SelfCognitionProcessor"))
        response = fill(_text(row, "response", "SelfCognitionProcessor"))
        return {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": query}, {"role": "assistant", "content": response}]}

    return fn


def alpaca(_: Args) -> Fn:
    def fn(row: Row) -> Row:
        instruction = row.get("instruction") or ""
        input_text = row.get("input") or ""
        output_text = row.get("output") or ""
        if not all(isinstance(v, str) for v in (instruction, input_text, output_text)):
            raise PreprocessError("AlpacaProcessor: instruction, input and output must hold text")
        prompt = instruction if not input_text else f"{instruction}\n{input_text}"
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": output_text}]}

    return fn


def competition_math(_: Args) -> Fn:
    def fn(row: Row) -> Row:
        problem = _text(row, "problem", "CompetitionMathProcessor")
        solution = _text(row, "solution", "CompetitionMathProcessor")
        return {"messages": [{"role": "user", "content": problem}, {"role": "assistant", "content": solution}]}

    return fn


def gsm8k(args: GSM8KArgs) -> Fn:
    system = args.system if args.system is not None else GSM8K_SYSTEM

    def fn(row: Row) -> Row:
        question = _text(row, "question", "GSM8KProcessor")
        answer = row.get("answer", "")
        if not isinstance(answer, str):
            raise PreprocessError("GSM8KProcessor: column 'answer' must hold text")
        match = re.search(r"####\s*([\-\d,.]+)", answer)
        truth = match.group(1).replace(",", "").strip() if match else ""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if args.add_assistant:
            messages.append({"role": "assistant", "content": answer})
        return {"messages": messages, "user_data": [["ground_truth", truth]]}

    return fn


BUILDERS: dict[str, Callable[[Any], Fn]] = {
    "SelfCognitionProcessor": self_cognition,
    "AlpacaProcessor": alpaca,
    "CompetitionMathProcessor": competition_math,
    "GSM8KProcessor": gsm8k,
}


def apply(fn: Fn, rows: list[Row]) -> list[Row]:
    """The rows with the preprocessor's columns set (the others kept); PreprocessError names the failing row."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append({**row, **fn(row)})
        except PreprocessError as e:
            raise PreprocessError(f"row {i}: {e}") from None
    return out
