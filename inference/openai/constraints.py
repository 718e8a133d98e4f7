"""A request's output constraint as a grammar: ``response_format`` and the extension fields
(vLLM's ``guided_*`` and ``structured_outputs``, llama-server's ``grammar`` and ``json_schema``).

The grammar text goes into the request's generation spec; the engine client compiles one matcher
of it per choice (:meth:`~inference.serving.engine_client.EngineClient.generate`). Every step runs off
the event loop under ``--grammar-compile-timeout`` (:meth:`EngineClient.compile_grammar`); a bad
schema is a 400 naming its field. A forced tool call's grammar is the chat turn's
(``chat._output_grammar``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from inference.openai.errors import InvalidRequestError
from inference.openai.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from inference.serving.engine_client import EngineClient
from inference.serving.structured import StructuredOutputError

__all__ = ["guided_grammar", "response_format_grammar"]


def _schema_object(value: object, param: str) -> object:
    """A JSON Schema given as an object or (vLLM's ``guided_json``) as JSON text."""
    if isinstance(value, str):
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError:
            message = f"{param} is neither a JSON Schema object nor its JSON text"
            raise StructuredOutputError(message, param) from None
    return value


async def response_format_grammar(client: EngineClient, fmt: ResponseFormat | None) -> str | None:
    """The grammar ``response_format`` asks for (None for plain text); 400 when it is bad."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return await client.compile_grammar(client.grammars.json_object_grammar)
    if fmt.type != "json_schema":
        raise InvalidRequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema'; got {fmt.type!r}",
            param="response_format.type",
        )
    spec = fmt.json_schema
    if spec is None or spec.schema is None:
        raise InvalidRequestError(
            "response_format of type 'json_schema' needs json_schema.schema",
            param="response_format.json_schema" + (".schema" if spec is not None else ""),
        )
    schema = spec.schema
    where = "response_format.json_schema.schema"
    return await client.compile_grammar(
        lambda: client.grammars.json_schema_grammar(schema, param=where), param=where
    )


async def guided_grammar(
    client: EngineClient, req: CompletionRequest | ChatCompletionRequest, taken: str | None
) -> str | None:
    """The grammar of the extension constraint the request names (vLLM's ``guided_*`` and
    ``structured_outputs``, llama-server's ``grammar`` and ``json_schema``), None without one.

    ``taken``: the field that already constrains the output (``response_format``, a forcing
    ``tool_choice``); one request takes one constraint, so a second is a 400 naming it.
    """
    g = client.grammars
    asked: list[tuple[str, Callable[[], str]]] = []

    def schema(param: str, value: object) -> None:
        asked.append((param, lambda: g.json_schema_grammar(_schema_object(value, param), param=param)))

    def regex(param: str, value: object) -> None:
        asked.append((param, lambda: g.regex_grammar(value, param=param)))

    def choice(param: str, value: object) -> None:
        asked.append((param, lambda: g.choice_grammar(value, param=param)))

    def lark(param: str, value: object) -> None:
        asked.append((param, lambda: g.lark_grammar(value, param=param)))

    for name, value, add in (
        ("guided_json", req.guided_json, schema),
        ("guided_regex", req.guided_regex, regex),
        ("guided_choice", req.guided_choice, choice),
        ("guided_grammar", req.guided_grammar, lark),
        ("grammar", req.grammar, lark),
        ("json_schema", req.json_schema, schema),
    ):
        if value is not None:
            add(name, value)
    so = req.structured_outputs
    if so is not None:
        for name, value, add in (
            ("json", so.json, schema),
            ("regex", so.regex, regex),
            ("choice", so.choice, choice),
            ("grammar", so.grammar, lark),
        ):
            if value is not None:
                add(f"structured_outputs.{name}", value)
        if so.json_object:
            asked.append(("structured_outputs.json_object", g.json_object_grammar))
    if not asked:
        return None
    first = asked[0][0]
    if taken is not None or len(asked) > 1:
        other, param = (taken, first) if taken is not None else (first, asked[1][0])
        raise InvalidRequestError(
            f"{param} cannot be combined with {other}: a request takes one output constraint",
            param=param,
        )
    grammar: str = await client.compile_grammar(asked[0][1], param=first)
    return grammar
