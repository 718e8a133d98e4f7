"""Null for an optional request field means its default: the one rule, for every route body.

OpenAI's API reference (its SDK types such fields ``Optional[...]``) lets a client send
``null`` for a field it leaves unset, and many clients do, for every field. Rather than widen
field after field (and teach every reader of ``req.n`` that it may be None), each route body
is decoded as its *wire type*: the same struct with every optional top-level field also
admitting null (:func:`wire_type`); :func:`from_wire` then builds the request the endpoints
read, a null field taking its declared default. Required fields stay non-null (a 400 naming
them), and nested objects keep their own types. The wire type is what the OpenAPI schema
shows, so the schema says which fields take null.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, TypeVar

import msgspec

__all__ = ["from_wire", "wire_type"]

Req = TypeVar("Req", bound=msgspec.Struct)


def _optional(field: msgspec.structs.FieldInfo) -> bool:
    return field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT


@functools.cache
def wire_type(request: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``request`` as it is decoded from JSON: same name, fields, JSON names, defaults and
    unknown-field rule; every field with a default also takes null (see :func:`from_wire`)."""
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(request):
        if not _optional(f):
            fields.append((f.name, f.type, msgspec.field(name=f.encode_name)))
        else:
            default = (
                msgspec.field(default=f.default, name=f.encode_name)
                if f.default_factory is msgspec.NODEFAULT
                else msgspec.field(default_factory=f.default_factory, name=f.encode_name)
            )
            fields.append((f.name, Optional[f.type], default))  # noqa: UP045 - f.type may be Any
    config = request.__struct_config__
    return msgspec.defstruct(
        request.__name__,
        fields,
        module=request.__module__,
        namespace={"__doc__": request.__doc__},
        kw_only=True,
        forbid_unknown_fields=config.forbid_unknown_fields,
    )


def from_wire(body: msgspec.Struct, request: type[Req]) -> Req:
    """The ``request`` a decoded wire body stands for: each optional field sent as null takes
    its default, every other value is kept as decoded."""
    values = {}
    for f in msgspec.structs.fields(request):
        value = getattr(body, f.name)
        if value is None and _optional(f):
            continue
        values[f.name] = value
    return request(**values)
