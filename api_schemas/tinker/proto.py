"""Protobuf conversion for the binary parts of the Tinker API: forward_backward requests in, their outputs and
sample responses out.

Uses the pinned SDK's `tinker_public_pb2`; the SDK ships only the client side of these codecs, this is the inverse.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.arrays import Column
from api_schemas.jobs import ForwardBackwardResult, SampleResult
from api_schemas.tinker.provenance import Provenance, ProvenanceError, decode_provenance

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
_DECODED: dict[int, np.dtype] = {  # what a decoded array holds: native byte order, int32 widened
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int64),
}
_INT32 = _DTYPES[pb.DTYPE_INT32]  # a chunk's token ids
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024


class ProtoDecodeError(ValueError):
    """The body is not a well-formed request; the message says what is wrong."""


@dataclass(frozen=True)
class DecodedDatum:
    tokens: np.ndarray  # int64 (N,), the model input
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, dense, int64 or float32
    provenance: Provenance | None = None  # Datum.with_provenance's spans (api_schemas/tinker/provenance.py)


@dataclass(frozen=True)
class DecodedForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DecodedDatum]


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    if not content_encoding or content_encoding.lower() == "identity":
        return body
    if content_encoding.lower() != "zstd":
        raise ProtoDecodeError(f"unsupported Content-Encoding {content_encoding!r} (use zstd or none)")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED_BYTES)
    except zstandard.ZstdError as e:
        raise ProtoDecodeError(f"invalid zstd body: {e}") from e


def parse_forward_backward(raw: bytes) -> pb.ForwardBackwardRequest:
    try:
        return pb.ForwardBackwardRequest.FromString(raw)
    except Exception as e:  # protobuf raises DecodeError, but be tolerant of its variants
        raise ProtoDecodeError(f"body is not a ForwardBackwardRequest protobuf: {e}") from e


def decode_tensor(name: str, t: pb.Tensor) -> np.ndarray:
    """A writable array in the machine's byte order (int32 widened to int64)."""
    code = t.dtype
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: unsupported dtype {code}")
    shape = tuple(t.shape)
    if shape and min(shape) < 0:
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: negative dimension in shape {shape}")
    enc = t.WhichOneof("encoding")
    if enc == "dense":
        dense = t.dense
        if len(dense) % dtype.itemsize:
            raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: byte length not a multiple of the dtype size")
        arr = np.frombuffer(dense, dtype=dtype)
        if shape:
            if math.prod(shape) != arr.size:
                raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: {arr.size} values do not fit shape {list(shape)}")
            arr = arr.reshape(shape)
    elif enc == "sparse_csr":
        arr = _decode_csr(name, t.sparse_csr, dtype, shape)
    else:
        arr = np.zeros(shape or (0,), dtype=dtype)
    return arr.astype(_DECODED[code])  # a copy: frombuffer's view of the message is read-only


def _decode_csr(name: str, csr: pb.SparseCsr, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) != 2:
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: sparse tensors need a 2-D shape, got {list(shape)}")
    rows, cols = shape
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    if crow.size != rows + 1 or col.size != values.size or (crow.size and (crow[0] != 0 or crow[-1] != values.size)):
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: inconsistent CSR indices")
    if np.any(np.diff(crow) < 0) or (col.size and (col.min() < 0 or col.max() >= cols)):
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: CSR index out of range")
    dense = np.zeros(shape, dtype=dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return dense


def decode_forward_backward(msg: pb.ForwardBackwardRequest) -> DecodedForwardBackward:
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ProtoDecodeError(f"datum {i}: {kind} chunks are not supported by this text model")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise ProtoDecodeError(f"datum {i}: token bytes are not int32")
            parts.append(np.frombuffer(raw, dtype=_INT32))
        tokens = np.concatenate(parts, dtype=np.int64) if parts else np.zeros(0, dtype=np.int64)
        inputs = {k: decode_tensor(k, v) for k, v in d.loss_fn_inputs.items()}
        try:
            provenance = decode_provenance(d)
        except ProvenanceError as e:
            raise ProtoDecodeError(f"datum {i}: {e}") from e
        data.append(DecodedDatum(tokens=tokens, inputs=inputs, provenance=provenance))
    config: dict[str, float | str]
    if len(msg.loss_fn_config_v2):
        config = {
            k: (v.text if v.WhichOneof("value") == "text" else float(v.number)) for k, v in msg.loss_fn_config_v2.items()
        }
    else:
        config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    return DecodedForwardBackward(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=bool(msg.forward_only),
        data=data,
    )


def batch_datums(req: DecodedForwardBackward) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """The request's datums as ForwardBackward.build takes them: (tokens, loss inputs)."""
    return [(d.tokens, d.inputs) for d in req.data]


def encode_forward_backward_result(result: ForwardBackwardResult) -> bytes:
    """A typed forward/backward result as the SDK's ForwardBackwardOutput: one ArrayRecord holding every datum's
    outputs, in request order. Each output Column already is a BatchedTensor's bytes (no copy through numpy).

    This runs on the gateway's event loop for every training step, so the message is written in protobuf's wire
    format directly (field numbers as in the SDK's tinker_public_pb2, named below; tests/unit/test_columns.py
    parses it back with the SDK's classes): building it through the generated classes cost about twice the CPU,
    most of it in creating the nested messages."""
    record = [_ARRAY_RECORD]  # ArrayRecord: 1 type_tag, 2 fields (map<string, BatchedTensor>), 3 num_datums
    count = 0
    for name, column in result.outputs.items():
        count = max(count, len(column.shapes))
        record.append(_message(2, _text(1, name) + _message(2, _batched_tensor(column))))
    record.append(_varint_field(3, count))
    out = [_ARRAY_RECORD, _message(2, b"".join(record))]  # 1 loss_fn_output_type, 2 loss_fn_outputs
    for key, value in result.metrics.items():  # 3 metrics (map<string, double>)
        out.append(_message(3, _text(1, key) + _FIXED64_2 + struct.pack("<d", value)))
    return b"".join(out)


def _batched_tensor(column: Column) -> bytes:
    """BatchedTensor: 1 data, 2 offsets (int64 byte offsets of each datum, and the end), 3 dtype, 4 trailing_shape
    (packed; the dimensions after the first, as the first datum's array has them)."""
    itemsize = 8 if column.dtype == "int64" else 4
    ends, end, first = [0], 0, None
    for shape in column.shapes:
        if shape is not None:
            end += math.prod(shape) * itemsize
            first = shape if first is None else first
        ends.append(end)
    tensor = _message(1, column.data) + _message(2, struct.pack(f"<{len(ends)}q", *ends))
    tensor += _varint_field(3, pb.DTYPE_INT64 if column.dtype == "int64" else pb.DTYPE_FLOAT32)
    if first is not None and len(first) > 1:
        tensor += _message(4, b"".join(_varint(d) for d in first[1:]))
    return tensor


_FIXED64_2 = bytes([2 << 3 | 1])  # a map entry's value field (2) holding a double
_BYTE = [bytes([n]) for n in range(0x80)]  # the varints of one byte


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _BYTE[number << 3] + _varint(value)  # every field number here is below 16: its tag is one byte


def _message(number: int, payload: bytes) -> bytes:
    """A length-delimited field: bytes, a string's UTF-8, a nested message, a map entry or a packed list."""
    return _BYTE[number << 3 | 2] + _varint(len(payload)) + payload


def _text(number: int, text: str) -> bytes:
    return _message(number, text.encode())


_ARRAY_RECORD = _text(1, "ArrayRecord")  # field 1 of both messages: ArrayRecord's type_tag, the output's type


def _topk(ids: np.ndarray, lps: np.ndarray) -> pb.TopkLogprobs:
    n, k = ids.shape
    return pb.TopkLogprobs(
        token_ids=np.ascontiguousarray(ids, dtype="<i4").tobytes(),
        logprobs=np.ascontiguousarray(lps, dtype="<f4").tobytes(),
        k=k,
        length=n,
    )


def encode_sample_response(out: SampleResult) -> bytes:
    msg = pb.SampleResponse(prompt_cache_hit_tokens=out.prompt_cache_hit_tokens)
    for seq in out.sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_ids is not None and seq.topk_logprobs is not None:
            s.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_ids.numpy(), seq.topk_logprobs.numpy()))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs = out.prompt_logprobs.numpy().astype("<f4").tobytes()
    if out.topk_prompt_ids is not None and out.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(out.topk_prompt_ids.numpy(), out.topk_prompt_logprobs.numpy()))
    return msg.SerializeToString()
