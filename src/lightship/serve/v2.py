"""KServe V2 / Open Inference Protocol (REST) with the binary tensor extension: bytes <-> numpy.

No model and no web framework here: `decode_request` turns a request body into an array and the
outputs asked for, `encode_response` turns logits back into a body and its headers.

Binary extension: the body is a JSON header of `Inference-Header-Content-Length` bytes followed
by the raw tensors, in input order, each `parameters.binary_data_size` bytes (little-endian,
row-major). Outputs asked for with `parameters.binary_data: true` (or all outputs, with the
request parameter `binary_data_output: true`, which `tritonclient` sends when it names none)
come back the same way. Classification (`parameters.classification: k`) answers BYTES
`"score:index:label"`, best first, as Triton does.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from lightship.runtime.base import softmax
from lightship.serve.batcher import TooManyRows

HEADER_LENGTH = "Inference-Header-Content-Length"
OUTPUTS = ("logits", "probabilities")
VERSION = "1"

# Little-endian, as the binary extension specifies. BOOL, BYTES and BF16 make no sense as pixels.
DATATYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in {
        "UINT8": "u1",
        "UINT16": "<u2",
        "UINT32": "<u4",
        "UINT64": "<u8",
        "INT8": "i1",
        "INT16": "<i2",
        "INT32": "<i4",
        "INT64": "<i8",
        "FP16": "<f2",
        "FP32": "<f4",
        "FP64": "<f8",
    }.items()
}
ALL_DATATYPES = (*DATATYPES, "BOOL", "BYTES", "BF16")


class ProtocolError(ValueError):
    """The request breaks the protocol; answered with `status` and `{"error": message}`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    name: str
    binary: bool
    classification: int = 0  # k > 0: top-k "score:index:label" strings instead of the tensor


@dataclass(slots=True)
class InferRequest:
    id: str | None
    x: np.ndarray  # the input as sent (any numeric dtype), reshaped to its declared shape
    outputs: list[RequestedOutput]
    timeout_s: float | None  # the request's own deadline, from parameters.timeout (µs)


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


# Python's json.dumps, and so tritonclient, writes a NaN or infinite float as these bare tokens;
# they are not JSON, and orjson's own message points at a column without naming them.
_NON_FINITE = ("NaN", "Infinity")


def json_error(exc: orjson.JSONDecodeError) -> ProtocolError:
    """The 400 for a body orjson could not parse: NaN and Infinity, which Python's json writes
    for non-finite floats, said as what they are."""
    token = next((t for t in _NON_FINITE if exc.doc.startswith(t, exc.pos)), None)
    if token is not None:
        return ProtocolError(
            f"the body contains {token} (line {exc.lineno} column {exc.colno}), which JSON does"
            " not allow: send finite numbers (pixels are 0..255)"
        )
    if "not valid UTF-8" in str(exc):
        # orjson checks the whole body first and says "surrogates not allowed ... (char 0)" of
        # an image or a form, wherever its first byte past ASCII is
        return ProtocolError("malformed JSON: the body is not UTF-8 text")
    return ProtocolError(f"malformed JSON: {exc}")


def not_json_at_all(exc: orjson.JSONDecodeError) -> bool:
    """Whether the body was no JSON from its first byte (an image, raw bytes, a multipart
    form: `--` and its boundary), not JSON broken further on: then where it should have gone
    is the useful part of the 400."""
    return exc.pos == 0 or exc.doc.startswith("--")


def _parse_json(raw: bytes | memoryview, header_length: str | None = None) -> dict[str, Any]:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        error = json_error(exc)
        hint = ""
        if header_length is None and b'"binary_data_size"' in bytes(raw):
            # orjson says "unexpected content after document", or "not valid UTF-8"
            hint = (
                f" (binary tensors follow the JSON: say its length in the {HEADER_LENGTH} header)"
            )
        elif header_length is None and not_json_at_all(exc):
            hint = (
                f" (a body that is the input's raw UINT8 tensor needs the header {HEADER_LENGTH}:"
                " 0; a JSON request with binary tensors after it, the JSON's length)"
            )
        elif header_length is not None:
            hint = (
                f" in the first {len(raw)} bytes, which {HEADER_LENGTH} says are the JSON "
                "header: set it to the JSON's length in bytes"
            )
        raise ProtocolError(f"{error}{hint}") from None
    return _object(doc, "request body")


# An image batch is [N, C, H, W]; a declared shape beyond these bounds cannot be a request
# (numpy itself refuses > 64 dimensions or > 2**63 bytes, with errors that are not the client's).
MAX_RANK = 8
MAX_ELEMENTS = 2**40  # counting a 0 dimension as 1: numpy sizes the other dimensions anyway


def _shape(
    tensor: dict[str, Any], max_rows: int | None = None, chw: tuple[int, ...] | None = None
) -> list[int]:
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        # orjson reads an integer of 2**64 or more as a float: an integer all the same
        if isinstance(shape, list) and any(
            isinstance(d, float) and d >= 2**64 and d.is_integer() for d in shape
        ):
            raise ProtocolError(_too_large(shape))
        raise ProtocolError(f"input shape must be a list of non-negative integers, got {shape!r}")
    if len(shape) > MAX_RANK:
        raise ProtocolError(
            f"input shape {shape if len(shape) <= 16 else f'of {len(shape)} dimensions'} is "
            "not an image batch: send [N, C, H, W]"
        )
    # [N, C, H, W] (a 3-D shape is one image): N is refused here, before its data is decoded;
    # images of another layout are refused for that (`Predictor.check`), not told to split
    rows = shape[0] if len(shape) == 4 and (chw is None or tuple(shape[1:]) == chw) else 0
    if max_rows is not None and rows > max_rows:
        raise TooManyRows.of(rows, max_rows)
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise ProtocolError(_too_large(shape))
    return shape


def _too_large(shape: list[Any]) -> str:
    return (
        f"input shape {shape} is too large to be an image batch (over {MAX_ELEMENTS:,} values): "
        "send [N, C, H, W]"
    )


def _parameters(value: Any, what: str) -> dict[str, Any]:
    """A V2 `parameters` member: absent/null means none, anything else must be an object."""
    return {} if value is None else _object(value, what)


def _datatype(tensor: dict[str, Any]) -> np.dtype[Any]:
    name = tensor.get("datatype")
    dtype = DATATYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        known = "a known datatype" if name not in ALL_DATATYPES else "supported for pixels"
        raise ProtocolError(
            f"input datatype {name!r} is not {known}: send UINT8 pixels "
            "(or FP32 / integer values 0..255)"
        )
    return dtype


def holds_bool(data: list[Any]) -> bool:
    """Whether (nested) lists hold a JSON true/false, which bytes() and numpy take as 1/0.
    A loop, not recursion: a body of a few hundred `[` would end in RecursionError."""
    pending = [data]
    while pending:
        items = pending.pop()
        types = set(map(type, items))
        if bool in types:
            return True
        if list in types:
            pending.extend(d for d in items if type(d) is list)
    return False


def _check_range(low: float, high: float, dtype: np.dtype[Any], name: str) -> None:
    """Refuse data whose least or greatest value (Python numbers: exact) `dtype` cannot hold."""
    integer = dtype.kind in "iu"
    highest: float = np.iinfo(dtype).max if integer else float(np.finfo(dtype).max)
    lowest: float = np.iinfo(dtype).min if integer else -highest
    if low < lowest or high > highest:
        raise ProtocolError(
            f"input data value {low if low < lowest else high} is out of range for {name} "
            f"({lowest}..{highest})"
        )


def _from_json_data(
    data: Any, shape: list[int], dtype: np.dtype[Any], name: str, may_hold_bools: bool = True
) -> np.ndarray:
    if not isinstance(data, list):
        raise ProtocolError(f"input data must be a list of numbers, got {type(data).__name__}")
    if may_hold_bools and holds_bool(data):
        raise ProtocolError(f"input data holds true/false but its datatype is {name}: send numbers")
    expected = math.prod(shape)
    if dtype == np.uint8 and data and not isinstance(data[0], list):
        # The common case, flat UINT8 pixels: bytes() converts a list of ints 4-5x faster than
        # numpy and raises on anything outside 0..255; other data takes the general path below.
        try:
            raw = bytes(data)
        except (TypeError, ValueError):
            pass
        else:
            if len(raw) != expected:
                raise ProtocolError(
                    f"input shape {shape} holds {expected} values but data has {len(raw)}"
                )
            return np.frombuffer(raw, np.uint8).reshape(shape)
    try:
        x = np.asarray(data)
    except ValueError:  # ragged, or nested deeper than numpy's 64 dimensions
        raise ProtocolError(
            "input data is ragged or nested too deep: nest it as its shape says, or send it flat"
        ) from None
    if x.size == 0:  # np.asarray([]) is float64: keep the declared type, the shape decides
        x = x.astype(dtype)
    if x.dtype.kind not in "iuf":
        raise ProtocolError(
            f"input data holds values that are not numbers but its datatype is {name}"
        )
    if x.dtype.kind == "f" and dtype.kind in "iu":
        # Not only fractions: numpy makes floats of int64 and uint64 values together, orjson of
        # integers beyond 64 bits. The values as parsed tell which (Python compares exactly).
        values = np.asarray(data, dtype=object).ravel().tolist()
        floats = [v for v in values if type(v) is float]
        # before the range: 255.4 is refused for what it is, not for being above 255
        if any(not v.is_integer() for v in floats):
            raise ProtocolError(f"input data holds fractional numbers but its datatype is {name}")
        _check_range(min(values), max(values), dtype, name)
        if floats:  # 3.0, 1e2, or an integer beyond 64 bits (rounded: not the value sent)
            raise ProtocolError(
                f"input data holds {floats[0]!r}, a JSON float (written with a point or an "
                f"exponent, or an integer beyond 64 bits), but its datatype is {name}: "
                "send integers"
            )
        x = np.array(values, dtype).reshape(x.shape)
    elif x.size:
        _check_range(x.min().item(), x.max().item(), dtype, name)
    if x.size != expected:
        raise ProtocolError(f"input shape {shape} holds {expected} values but data has {x.size}")
    return x.reshape(shape)


def _no_inputs(doc: dict[str, Any], input_name: str) -> str:
    """Why a body without an `inputs` list is refused, and what goes where: the simple
    protocol's `{"instances": ...}` sent here is the common mistake."""
    inputs = doc.get("inputs")
    what = (
        'the body has no "inputs" list'
        if inputs is None
        else f"inputs must be a list, got {type(inputs).__name__}"
    )
    v1_hint = '; for {"instances": [...]} use /v1/predict' if "instances" in doc else ""
    return f"{what} (V2 format: {_example(input_name)}){v1_hint}"


def _example(input_name: str) -> str:
    return (
        f'{{"inputs": [{{"name": "{input_name}", "shape": [...], "datatype": "UINT8", '
        '"data": [...]}]}'
    )


def json_length(body: bytes, header_length: str | None) -> int:
    """The bytes of JSON a request begins with: all of `body`, or as many as its
    Inference-Header-Content-Length says (binary tensors follow; 0: none, the body is the
    input's tensor, `raw_request`); ProtocolError if that is no count of bytes within the
    body."""
    if header_length is None:
        return len(body)
    if not (header_length.isascii() and header_length.isdigit()):  # int() takes "1_0"
        raise ProtocolError(
            f"{HEADER_LENGTH} must be the JSON header's length in bytes (0 or more), got "
            f"{header_length!r}"
        )
    try:
        json_end = int(header_length)
    except ValueError:  # more digits than Python converts (4,300): more than any body
        json_end = -1
    if not 0 <= json_end <= len(body):
        said = header_length if len(header_length) <= 20 else header_length[:19] + "..."
        raise ProtocolError(f"{HEADER_LENGTH} is {said} but the body has {len(body)} bytes")
    return json_end


def decode_request(
    body: bytes,
    header_length: str | None,
    input_name: str,
    outputs: tuple[str, ...] = OUTPUTS,
    max_rows: int | None = None,
    chw: tuple[int, ...] | None = None,
) -> InferRequest:
    """Parse an infer request (JSON, or JSON header + binary tensors) for a one-input model;
    a batch over `max_rows` of images of the model's `chw` is refused (`TooManyRows`) before
    its JSON data becomes an array."""
    if not body and header_length is None:  # not "Inference-Header-Content-Length is 0"
        raise ProtocolError(f"the body is empty: send an infer request ({_example(input_name)})")
    json_end = json_length(body, header_length)
    if json_end == 0:
        return raw_request(body, outputs, max_rows, chw)
    view = memoryview(body)
    doc = _parse_json(view[:json_end], header_length)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"id must be a string, got {type(request_id).__name__}")
    params = _parameters(doc.get("parameters"), "parameters")

    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise ProtocolError(_no_inputs(doc, input_name))
    if len(inputs) != 1:
        raise ProtocolError(f"this model takes exactly one input '{input_name}'; got {len(inputs)}")
    tensor = _object(inputs[0], "input")
    if tensor.get("name") != input_name:
        raise ProtocolError(
            f"unknown input {tensor.get('name')!r}: this model's input is '{input_name}'"
        )
    shape = _shape(tensor, max_rows, chw)
    dtype = _datatype(tensor)
    tparams = _parameters(tensor.get("parameters"), "input parameters")
    if "shared_memory_region" in tparams:
        raise ProtocolError("shared memory is not supported: send the tensor in the body")
    size = tparams.get("binary_data_size")
    binary = view[json_end:]
    if size is not None:
        if "data" in tensor:
            raise ProtocolError("input has both data and binary_data_size: send one")
        expected = math.prod(shape) * dtype.itemsize
        if not isinstance(size, int) or isinstance(size, bool):
            raise ProtocolError(f"binary_data_size must be an integer, got {size!r}")
        if size != expected or len(binary) != expected:
            raise ProtocolError(
                f"input {shape} {tensor['datatype']} needs {expected} bytes; "
                f"binary_data_size is {size!r} and the body carries {len(binary)} after the header"
            )
        x = np.frombuffer(binary, dtype=dtype).reshape(shape)
    else:
        if len(binary):
            raise ProtocolError(
                f"{len(binary)} bytes follow the JSON header but no input has binary_data_size"
            )
        if "data" not in tensor:
            raise ProtocolError("input has neither data nor parameters.binary_data_size")
        # JSON spells booleans out: a body without "true" and "false" holds none, and scanning
        # it is several times cheaper than looking at the type of every value.
        may_hold_bools = (
            body.find(b"true", 0, json_end) >= 0 or body.find(b"false", 0, json_end) >= 0
        )
        x = _from_json_data(tensor["data"], shape, dtype, tensor["datatype"], may_hold_bools)

    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise ProtocolError(f"binary_data_output must be true or false, got {binary_default!r}")
    requested = doc.get("outputs")
    if requested is not None and not isinstance(requested, list):
        raise ProtocolError("outputs must be a list")
    if not requested:  # absent or [] asks for every output, as in Triton
        wanted = [RequestedOutput(name, binary_default) for name in outputs]
    else:
        wanted = [_requested(_object(o, "output"), outputs, binary_default) for o in requested]
        names = [w.name for w in wanted]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ProtocolError(f"output {twice[0]!r} is asked for twice: ask once")
    timeout = params.get("timeout")
    timeout_s = None
    if timeout is not None:
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise ProtocolError(
                f"parameters.timeout must be microseconds (0: none), got {timeout!r}"
            )
        # 0 is no deadline of the request's own, as Triton reads it (tritonclient sends it)
        timeout_s = timeout / 1e6 if timeout else None
    return InferRequest(request_id, x, wanted, timeout_s)


def raw_request(
    body: bytes,
    outputs: tuple[str, ...] = OUTPUTS,
    max_rows: int | None = None,
    chw: tuple[int, ...] | None = None,
) -> InferRequest:
    """Triton's raw binary request (its binary data extension: Inference-Header-Content-Length
    0, for a model of one input): the body is that input's tensor, of the datatype the model's
    metadata gives (UINT8), its rows read from its size; every output comes back binary."""
    if chw is None:  # a caller that knows no input shape (the benchmark's no-model ceiling)
        raise ProtocolError(f"{HEADER_LENGTH} 0 (the body a raw tensor) is not taken here")
    row = math.prod(chw)
    if not body or len(body) % row:
        shape = ", ".join(map(str, chw))
        raise ProtocolError(
            f"{HEADER_LENGTH} is 0, so the body is the input tensor, UINT8 [N, {shape}]: "
            f"{row} bytes an image, and the body has {len(body)}; to send JSON, give the "
            "JSON's length in that header or leave it out"
        )
    rows = len(body) // row
    if max_rows is not None and rows > max_rows:
        raise TooManyRows.of(rows, max_rows)
    x = np.frombuffer(body, np.uint8).reshape(rows, *chw)
    return InferRequest(None, x, [RequestedOutput(name, True) for name in outputs], None)


def _requested(
    output: dict[str, Any], names: tuple[str, ...], binary_default: bool
) -> RequestedOutput:
    name = output.get("name")
    if name not in names:
        raise ProtocolError(f"unknown output {name!r}: this model has {', '.join(names)}")
    params = _parameters(output.get("parameters"), "output parameters")
    if "shared_memory_region" in params:
        raise ProtocolError("shared memory is not supported: ask for the output in the body")
    binary = params.get("binary_data", binary_default)
    k = params.get("classification", 0)
    if not isinstance(binary, bool):
        raise ProtocolError(f"binary_data must be true or false, got {binary!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ProtocolError(f"classification must be a non-negative integer, got {k!r}")
    return RequestedOutput(name, binary, k)


def _classify(values: np.ndarray, k: int, labels: list[str]) -> list[list[str]]:
    k = min(k, values.shape[1])
    top = np.argsort(-values, axis=1, kind="stable")[:, :k]
    return [
        [f"{row[i]:f}:{i}:{labels[i]}" for i in idx] for row, idx in zip(values, top, strict=True)
    ]


def _bytes_tensor(strings: list[str]) -> bytes:
    parts = []
    for s in strings:
        b = s.encode()
        parts.append(struct.pack("<I", len(b)) + b)
    return b"".join(parts)


def encode_response(
    logits: np.ndarray,
    outputs: list[RequestedOutput],
    labels: list[str],
    model_name: str,
    request_id: str | None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers for `logits` `[N, classes]` float32."""
    probabilities: np.ndarray | None = None
    described: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for out in outputs:
        if out.name == "logits":
            values = logits
        else:
            if probabilities is None:
                probabilities = softmax(logits).astype(np.float32, copy=False)
            values = probabilities
        tensor: dict[str, Any] = {"name": out.name}
        data: Any
        if out.classification:
            strings = _classify(values, out.classification, labels)
            tensor["datatype"] = "BYTES"
            tensor["shape"] = [len(strings), len(strings[0]) if strings else 0]
            flat = [s for row in strings for s in row]
            data, blob = flat, (_bytes_tensor(flat) if out.binary else b"")
        else:
            tensor["datatype"] = "FP32"
            tensor["shape"] = list(values.shape)
            data = np.ascontiguousarray(values, dtype=np.float32).ravel()
            blob = data.tobytes() if out.binary else b""
        if out.binary:
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = data
        described.append(tensor)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": VERSION}
    if request_id is not None:
        doc["id"] = request_id
    doc["outputs"] = described
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream",
        HEADER_LENGTH.lower(): str(len(header)),
    }


def model_metadata(
    name: str,
    platform: str,
    input_name: str,
    chw: tuple[int, int, int],
    labels: list[str],
    max_rows: int,
) -> dict[str, Any]:
    """`GET /v2/models/{name}`: inputs and outputs with -1 for the batch dimension, and the
    rows one request may carry (`max_batch_size`, as Triton's model configuration names it)."""
    return {
        "name": name,
        "versions": [VERSION],
        "platform": platform,
        "inputs": [{"name": input_name, "datatype": "UINT8", "shape": [-1, *chw]}],
        "outputs": [
            {"name": out, "datatype": "FP32", "shape": [-1, len(labels)]} for out in OUTPUTS
        ],
        "parameters": {"labels": labels, "max_batch_size": max_rows},
    }


def model_config(
    name: str,
    platform: str,
    input_name: str,
    chw: tuple[int, int, int],
    classes: int,
    max_rows: int,
    max_wait_ms: float,
    instances: int,
    gpu: bool,
) -> dict[str, Any]:
    """`GET /v2/models/{name}/config`, Triton's model configuration extension, in the JSON
    form Triton answers (dims without the batch dimension, `max_batch_size` > 0 for a model
    that batches), as `tritonclient`'s `get_model_config` returns it."""
    return {
        "name": name,
        "platform": platform,
        "backend": "onnxruntime" if platform.startswith("onnxruntime") else "pytorch",
        "max_batch_size": max_rows,
        "input": [
            {"name": input_name, "data_type": "TYPE_UINT8", "format": "FORMAT_NCHW", "dims": [*chw]}
        ],
        "output": [{"name": out, "data_type": "TYPE_FP32", "dims": [classes]} for out in OUTPUTS],
        "dynamic_batching": {"max_queue_delay_microseconds": round(max_wait_ms * 1000)},
        "instance_group": [{"count": instances, "kind": "KIND_GPU" if gpu else "KIND_CPU"}],
    }


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})
