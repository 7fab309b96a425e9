"""common/protocol.py and common/protocol_kv.py (whose messages protocol.py re-exports): every
message round-trips through encode/decode, bad frames are refused.

The sample of each message is built from its declared field types (msgspec.inspect), with every
field set to a value other than its default, so a message or field added later is covered without
editing this file, and a field that failed to travel would show as a difference.
"""

from __future__ import annotations

import dataclasses
import typing

import msgspec
import msgspec.inspect as mi
import pytest

from common import protocol, protocol_kv
from common.sampling_params import SamplingParams

CONTROL = typing.get_args(protocol.ControlMessage)
KV = typing.get_args(protocol.KVMessage)


def tagged_structs(module) -> list[type]:
    """Every tagged Struct `module` declares: a message (untagged ones, HistogramSnapshot, nest)."""
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, msgspec.Struct)
        and cls.__module__ == module.__name__
        and mi.type_info(cls).tag is not None
    ]


MESSAGES = tagged_structs(protocol) + tagged_structs(protocol_kv)


def sample(t: mi.Type, salt: int = 0):
    """A value of type `t`, never the type's zero (so it differs from a field's usual default)."""
    if isinstance(t, mi.StrType):
        return f"s{salt}"
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.IntType):
        return 7 + salt
    if isinstance(t, mi.FloatType):
        return 0.25 + salt
    if isinstance(t, mi.BytesType):
        return bytes([salt % 256, 0xFF])
    if isinstance(t, mi.LiteralType):
        return t.values[-1]
    if isinstance(t, mi.UnionType):
        return sample(next(u for u in t.types if not isinstance(u, mi.NoneType)), salt)
    if isinstance(t, mi.ListType):
        return [sample(t.item_type, salt), sample(t.item_type, salt + 1)]
    if isinstance(t, mi.TupleType):
        return tuple(sample(u, salt + i) for i, u in enumerate(t.item_types))
    if isinstance(t, mi.DictType):
        return {sample(t.key_type, salt): sample(t.value_type, salt)}
    if isinstance(t, (mi.StructType, mi.DataclassType)):
        return build(t.cls, salt)
    raise NotImplementedError(f"no sample for {t!r}: extend sample() for the new field type")


def build(cls: type, salt: int = 0):
    """An instance of `cls` with every field set (by its declared type) to a non-default value."""
    fields = mi.type_info(cls).fields
    return cls(**{f.name: sample(f.type, salt + i) for i, f in enumerate(fields)})


def default(field: mi.Field):
    return field.default_factory() if field.default_factory is not mi.NODEFAULT else field.default


def decoder_for(cls: type):
    return protocol.decode_control if cls in CONTROL else protocol.decode_kv


def test_every_message_is_in_exactly_one_union_with_a_unique_tag() -> None:
    assert len(MESSAGES) >= 14  # the 12 control messages and the 2 kv messages, at least
    assert set(MESSAGES) == set(CONTROL) | set(KV)
    assert not set(CONTROL) & set(KV)
    tags = [mi.type_info(cls).tag for cls in MESSAGES]
    assert len(tags) == len(set(tags))


def test_the_kv_messages_are_reexported_by_protocol() -> None:
    """common.protocol_kv's names import from common.protocol too (existing imports work)."""
    public = [name for name in vars(protocol_kv) if not name.startswith("_")]
    for name in public:
        if name not in ("annotations", "Annotated", "Literal", "Meta", "msgspec"):
            assert getattr(protocol, name) is getattr(protocol_kv, name), name


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.__name__)
def test_message_round_trips_with_every_field_set(cls: type) -> None:
    message = build(cls)
    for field in mi.type_info(cls).fields:  # the sample means something only if it is not default
        if not field.required:
            assert getattr(message, field.name) != default(field), field.name
    decoded = decoder_for(cls)(protocol.encode(message))
    assert type(decoded) is cls
    assert decoded == message
    for field in mi.type_info(cls).fields:  # nested values keep their types (tuples, dataclasses)
        assert type(getattr(decoded, field.name)) is type(getattr(message, field.name)), field.name


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.__name__)
def test_message_round_trips_with_only_required_fields(cls: type) -> None:
    fields = mi.type_info(cls).fields
    message = cls(**{f.name: sample(f.type, i) for i, f in enumerate(fields) if f.required})
    decoded = decoder_for(cls)(protocol.encode(message))
    assert decoded == message
    for field in fields:
        if not field.required:
            assert getattr(decoded, field.name) == default(field), field.name


def test_sampling_params_travel_whole() -> None:
    params = build(SamplingParams)
    message = protocol.Reserve("r", [1, 2, 3], params)
    decoded = protocol.decode_control(protocol.encode(message))
    assert isinstance(decoded.params, SamplingParams)
    assert dataclasses.asdict(decoded.params) == dataclasses.asdict(params)


@pytest.mark.parametrize("cls", KV, ids=lambda cls: cls.__name__)
def test_kv_message_on_the_control_socket_is_refused(cls: type) -> None:
    with pytest.raises(protocol.ProtocolError, match="bad control message"):
        protocol.decode_control(protocol.encode(build(cls)))


@pytest.mark.parametrize("cls", CONTROL, ids=lambda cls: cls.__name__)
def test_control_message_on_the_kv_socket_is_refused(cls: type) -> None:
    with pytest.raises(protocol.ProtocolError, match="bad kv message"):
        protocol.decode_kv(protocol.encode(build(cls)))


@pytest.mark.parametrize(
    "body, match",
    [
        ({"type": "abort", "request_id": 5}, r"Expected `str`, got `int` - at `\$.request_id`"),
        ({"type": "abort"}, r"missing required field `request_id`"),
        ({"type": "abort", "request_id": "r", "extra": 1}, r"unknown field `extra`"),
        ({"type": "no-such-message", "request_id": "r"}, r"Invalid value 'no-such-message'"),
        ({"request_id": "r"}, r"missing required field `type`"),
        (
            {
                "type": "register",
                **{f.name: sample(f.type) for f in mi.type_info(protocol.Register).fields},
                "role": "router",
            },
            r"Invalid enum value 'router' - at `\$.role`",
        ),
    ],
    ids=["wrong-field-type", "missing-field", "unknown-field", "unknown-tag", "no-tag", "bad-role"],
)
def test_wrong_type_frame_is_refused_with_the_field_named(body: dict, match: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=match):
        protocol.decode_control(msgspec.msgpack.encode(body))


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode(3)])
@pytest.mark.parametrize("decode", [protocol.decode_control, protocol.decode_kv])
def test_garbage_frame_is_a_protocol_error(decode, frame: bytes) -> None:
    with pytest.raises(protocol.ProtocolError, match="bad (control|kv) message"):
        decode(frame)


@pytest.mark.parametrize(
    "decode, what",
    [(protocol.decode_control, "control message"), (protocol.decode_kv, "kv header")],
)
def test_oversize_frame_is_refused_before_decoding(decode, what: str) -> None:
    frame = b"\x00" * (protocol.MAX_CONTROL_MESSAGE_BYTES + 1)
    with pytest.raises(protocol.ProtocolError, match=f"{what} of {len(frame)} bytes exceeds"):
        decode(frame)


def test_size_limit_is_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = protocol.encode(build(protocol.Reserve))
    monkeypatch.setattr(protocol, "MAX_CONTROL_MESSAGE_BYTES", len(frame))
    assert protocol.decode_control(frame) == build(protocol.Reserve)
    monkeypatch.setattr(protocol, "MAX_CONTROL_MESSAGE_BYTES", len(frame) - 1)
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):
        protocol.decode_control(frame)


def test_protocol_error_is_a_value_error() -> None:
    # Callers that guard a boundary with `except ValueError` catch bad frames too.
    assert issubclass(protocol.ProtocolError, ValueError)


def test_message_tag_is_read_without_decoding() -> None:
    assert protocol.message_tag(protocol.encode(protocol.Abort("r"))) == "abort"
    assert protocol.message_tag(protocol.encode(build(protocol.Heartbeat))) == "heartbeat"
    assert protocol.message_tag(b"\x00" * 16) == ""
    assert protocol.message_tag(b"") == ""


def test_small_messages_have_small_limits_and_bounded_fields() -> None:
    big = protocol.Heartbeat("w", 0, 0, 0, 0, counters={f"c{i}": 1.0 for i in range(50_000)})
    with pytest.raises(protocol.ProtocolError, match="heartbeat message of .* exceeds its limit"):
        protocol.decode_control(protocol.encode(big))
    many = protocol.Heartbeat("w", 0, 0, 0, 0, counters={f"c{i}": 1.0 for i in range(300)})
    with pytest.raises(protocol.ProtocolError, match="length <= 256"):
        protocol.decode_control(protocol.encode(many))
    negative = protocol.Heartbeat("w", -1, 0, 0, 0)
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_control(protocol.encode(negative))
    # a long prompt is no small message: only the overall limit applies
    prompt = list(range(200_000))
    reserve = protocol.Reserve("r", prompt, build(protocol.Reserve).params, deadline_s=5.0)
    assert protocol.decode_control(protocol.encode(reserve)) == reserve


@pytest.mark.parametrize("kind", ["Reserve", "Prefill", "Generate"])
def test_structured_output_travels_to_workers(kind: str) -> None:
    from common.sampling_params import StructuredOutput

    so = StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    message = build(getattr(protocol, kind))
    message.params = SamplingParams(max_tokens=5, structured_output=so)
    decoded = protocol.decode_control(protocol.encode(message))
    assert type(decoded.params.structured_output) is StructuredOutput
    assert decoded.params.structured_output == so
    plain = protocol.decode_control(protocol.encode(protocol.Generate("r", [1], SamplingParams())))
    assert plain.params.structured_output is None
    frame = protocol.encode(message).replace(b"\xa4kind", b"\xa4kinx")  # an unknown field name
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_control(frame)


def test_prompt_logprobs_are_bounded() -> None:
    # One prompt token's worst case (every number at its widest) fits PROMPT_LOGPROB_BYTES, so
    # the longest prompt allowed to ask for them fits MAX_KV_HEADER_BYTES and the control limit.
    from common.sampling_params import MAX_PROMPT_LOGPROB_TOKENS, MAX_TOP_LOGPROBS

    worst = (-1e30, 2**63 - 1, [(2**63 - 1, -1e30)] * MAX_TOP_LOGPROBS)
    assert len(protocol.encode(worst)) <= protocol.PROMPT_LOGPROB_BYTES
    assert protocol.MAX_KV_HEADER_BYTES <= protocol.MAX_CONTROL_MESSAGE_BYTES
    header = msgspec.structs.replace(build(protocol.KVHeader), prompt_logprobs=[worst])
    assert protocol.decode_kv(protocol.encode(header)) == header
    too_wide = (-1.0, 1, [(1, -1.0)] * (MAX_TOP_LOGPROBS + 1))
    too_long = [(-1.0, 1, [])] * (MAX_PROMPT_LOGPROB_TOKENS + 1)
    for bad in ([too_wide], too_long):
        out = msgspec.structs.replace(build(protocol.TokenOutput), prompt_logprobs=bad)
        with pytest.raises(protocol.ProtocolError, match="length <="):
            protocol.decode_control(protocol.encode(out))


def _token_output(rid: str, n: int = 1) -> protocol.TokenOutput:
    return protocol.TokenOutput(rid, list(range(n)), [], [], False, None, 3, 0)


def test_token_batch_carries_a_step_in_order_in_one_frame() -> None:
    outputs = [_token_output(f"r{i}", i % 3 + 1) for i in range(100)]
    frame = protocol.encode(protocol.TokenBatch(outputs))
    assert protocol.message_tag(frame) == "token_batch"
    decoded = protocol.decode_control(frame)
    assert isinstance(decoded, protocol.TokenBatch) and decoded.outputs == outputs
    # a lone TokenOutput (an older worker's, or the first token) is still a message of its own
    assert protocol.decode_control(protocol.encode(outputs[0])) == outputs[0]


def test_token_batch_is_bounded() -> None:
    too_many = [_token_output("r")] * (protocol.MAX_TOKEN_BATCH_OUTPUTS + 1)
    with pytest.raises(protocol.ProtocolError, match="length <= 65536"):
        protocol.decode_control(protocol.encode(protocol.TokenBatch(too_many)))
    frame = protocol.encode(protocol.TokenBatch([_token_output("r", 1000)] * 10))
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):
        protocol.decode_control(frame, max_bytes=len(frame) - 1)
    assert len(protocol.decode_control(frame, max_bytes=len(frame)).outputs) == 10
    # only token outputs travel in a batch
    wrong = msgspec.msgpack.encode({"type": "token_batch", "outputs": [protocol.Abort("r")]})
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_control(wrong)
