"""Dataclass conversions: to/from JSON-able dicts (state databases) and to/from protobuf messages.

Both directions match fields by name, so a core dataclass and its proto message stay in step without
hand-written converters. Enums: a core ``StrEnum`` value ``RUNNING`` maps to the proto enum value
``JOB_STATE_RUNNING`` (the proto enum's upper-snake name as prefix, buf style); ``UNSPECIFIED``/0 maps
to the dataclass default.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from functools import cache
from typing import Any, TypeVar

from strop.common.errors import InvalidArgument

T = TypeVar("T")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def to_dict(obj: Any) -> Any:
    """A dataclass (nested, with enums, lists, dicts) as plain JSON-able values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _from_value(tp: Any, value: Any) -> Any:
    tp = _unwrap_optional(tp)
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_from_value(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(tp)
        return {k: _from_value(item, v) for k, v in value.items()}
    return value


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Inverse of :func:`to_dict`; unknown keys are ignored (older rows read by newer code)."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _from_value(hints[f.name], data[f.name])
    return cls(**kwargs)


def _enum_prefix(enum_descriptor) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum_descriptor.name).upper() + "_"


def to_proto(msg_cls: type, obj: Any):
    """Build ``msg_cls`` from a dataclass by field name (fields the message lacks are skipped)."""
    msg = msg_cls()
    fields = msg.DESCRIPTOR.fields_by_name
    for f in dataclasses.fields(obj):
        if f.name not in fields:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        fd = fields[f.name]
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            getattr(msg, f.name).update({k: str(v) for k, v in value.items()})
        elif fd.message_type is not None:
            sub_cls = _message_class(fd)
            if _is_repeated(fd):
                getattr(msg, f.name).extend(to_proto(sub_cls, item) for item in value)
            else:
                getattr(msg, f.name).CopyFrom(to_proto(sub_cls, value))
        elif fd.enum_type is not None:
            name = value.value if isinstance(value, enum.Enum) else str(value)
            setattr(msg, f.name, fd.enum_type.values_by_name[_enum_prefix(fd.enum_type) + name].number)
        elif _is_repeated(fd):
            getattr(msg, f.name).extend(value)
        else:
            setattr(msg, f.name, value)
    return msg


def _is_repeated(fd) -> bool:
    if hasattr(fd, "is_repeated"):  # protobuf >= 5.28
        return fd.is_repeated
    return fd.label == fd.LABEL_REPEATED


def _message_class(fd) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(fd.message_type)


def from_proto(cls: type[T], msg) -> T:
    """Build dataclass ``cls`` from a protobuf message by field name.

    Unset sub-messages become ``None`` for optional dataclass fields; enum 0 (UNSPECIFIED) becomes
    the enum member ``UNSPECIFIED`` when the dataclass enum has one, else the dataclass default.
    """
    hints = _hints(cls)
    fields = msg.DESCRIPTOR.fields_by_name
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in fields:
            continue
        fd = fields[f.name]
        tp = hints[f.name]
        inner = _unwrap_optional(tp)
        value = getattr(msg, f.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            kwargs[f.name] = dict(value)
        elif fd.message_type is not None and _is_repeated(fd):
            (item,) = typing.get_args(inner)
            kwargs[f.name] = [from_proto(item, v) for v in value]
        elif fd.message_type is not None:
            if msg.HasField(f.name):
                kwargs[f.name] = from_proto(inner, value)
        elif fd.enum_type is not None:
            known = fd.enum_type.values_by_number.get(value)
            prefix = _enum_prefix(fd.enum_type)
            if known is None:  # a newer client's value, or garbage: the request is wrong, not the server
                valid = ", ".join(
                    f"{v.name[len(prefix) :]} ({v.number})" for v in fd.enum_type.values if v.number
                )
                raise InvalidArgument(
                    f"{msg.DESCRIPTOR.name}.{f.name}: unknown {fd.enum_type.name} value {value}; valid: {valid}"
                )
            name = known.name[len(prefix) :]
            if name in inner.__members__:
                kwargs[f.name] = inner[name]
        elif _is_repeated(fd):
            kwargs[f.name] = list(value)
        elif getattr(fd, "has_presence", False) and not msg.HasField(f.name):
            kwargs[f.name] = None  # a proto3 `optional` scalar left unset: "not checked", not its zero
        else:
            kwargs[f.name] = value
    return cls(**kwargs)
