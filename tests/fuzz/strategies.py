"""Hypothesis strategies for any tandem.v1 message, built from its descriptor: every field set or left
unset, scalars over their whole wire range (NaN, infinities, negative, huge), odd unicode, unknown
enum values. `Hints` bends chosen fields (by name) toward values that reach deeper than a random one.

Cost is bounded by construction: a request that would be valid never asks for more than
`CHEAP_MAX_TOKENS` tokens, so each example costs at most a short prefill and a few decode steps.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

VOCAB_SIZE = 49152  # the default model's
CONTEXT = 8192  # the default model's max_model_len
CHEAP_MAX_TOKENS = 4
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

Hints = Mapping[str, st.SearchStrategy]

# Text from every plane but the surrogates (protobuf strings are UTF-8): controls, combining marks,
# right-to-left, private use, emoji, unassigned code points.
odd_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
token_id = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.integers(*INT32))
# Valid and invalid max_tokens, never a valid one above CHEAP_MAX_TOKENS: past the context is refused.
max_tokens = st.one_of(st.integers(1, CHEAP_MAX_TOKENS), st.integers(INT32[0], 0), st.integers(CONTEXT + 1, INT32[1]))
int32s = st.one_of(st.integers(-2, 20), st.integers(*INT32))

_SCALARS: dict[int, st.SearchStrategy] = {
    FieldDescriptor.TYPE_INT32: int32s,
    FieldDescriptor.TYPE_SINT32: int32s,
    FieldDescriptor.TYPE_SFIXED32: int32s,
    FieldDescriptor.TYPE_INT64: st.one_of(st.integers(-2, 20), st.integers(*INT64)),
    FieldDescriptor.TYPE_SINT64: st.integers(*INT64),
    FieldDescriptor.TYPE_SFIXED64: st.integers(*INT64),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),  # NaN and infinities included
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: odd_text,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
}
# Field names every message shares a meaning for, wherever they appear.
COMMON_HINTS: dict[str, st.SearchStrategy] = {
    "max_tokens": max_tokens,
    "token_ids": st.lists(token_id, max_size=12),
    "stop_token_ids": st.lists(token_id, max_size=4),
    "prompt_token_ids": st.lists(token_id, max_size=12),
    "output_token_ids": st.lists(token_id, max_size=3),
}


def messages(descriptor: Descriptor, hints: Hints = COMMON_HINTS, depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type; a field named in `hints` draws from its hint (a repeated
    field's hint draws the whole list)."""
    cls = GetMessageClass(descriptor)
    fields = {field.name: _field(field, hints, depth) for field in descriptor.fields
              if field.message_type is None or depth > 0}
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: cls(**values))


def _field(field: FieldDescriptor, hints: Hints, depth: int) -> st.SearchStrategy:
    if field.name in hints:
        return hints[field.name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_field(key, hints, depth), _field(value, hints, depth), max_size=4)
    if field.message_type is not None:
        value = messages(field.message_type, hints, depth - 1)
    elif field.enum_type is not None:  # known values and unknown ones (proto3 enums are open)
        value = st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(*INT32))
    else:
        value = _SCALARS[field.type]
    return st.lists(value, max_size=4) if field.is_repeated else value
