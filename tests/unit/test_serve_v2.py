"""The V2 protocol and the simple v1 format on their own: bytes in, arrays out, and back."""

from __future__ import annotations

import io
import json
import re
import struct
import warnings

import numpy as np
import pytest
from PIL import Image, ImageOps, PngImagePlugin

from lightship.data import images
from lightship.serve import v1, v2
from lightship.serve.batcher import TooManyRows
from lightship.serve.v2 import ProtocolError, RequestedOutput

X = np.arange(8, dtype=np.uint8).reshape(2, 1, 2, 2)


def json_request(data: object, shape: list[int], datatype: str = "UINT8", **extra: object) -> bytes:
    doc: dict[str, object] = {
        "inputs": [{"name": "input", "shape": shape, "datatype": datatype, "data": data}]
    }
    doc.update(extra)
    return json.dumps(doc).encode()


def binary_request(x: np.ndarray, datatype: str = "UINT8", **extra: object) -> tuple[bytes, str]:
    raw = x.tobytes()
    doc: dict[str, object] = {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(raw)},
            }
        ]
    }
    doc.update(extra)
    header = json.dumps(doc).encode()
    return header + raw, str(len(header))


def test_json_flat_and_nested_data_decode_to_the_same_array() -> None:
    flat = v2.decode_request(json_request(X.ravel().tolist(), [2, 1, 2, 2]), None, "input")
    nested = v2.decode_request(json_request(X.tolist(), [2, 1, 2, 2]), None, "input")
    np.testing.assert_array_equal(flat.x, X)
    np.testing.assert_array_equal(nested.x, X)
    assert flat.id is None and flat.timeout_s is None
    assert [o.name for o in flat.outputs] == ["logits", "probabilities"]
    assert not any(o.binary for o in flat.outputs)


def test_binary_tensor_decodes_without_copy_semantics_changing_values() -> None:
    body, length = binary_request(X, id="r1", parameters={"binary_data_output": True})
    req = v2.decode_request(body, length, "input")
    np.testing.assert_array_equal(req.x, X)
    assert req.x.dtype == np.uint8 and req.id == "r1"
    assert all(o.binary for o in req.outputs)  # what tritonclient asks when it names no output


def test_fp32_binary_and_timeout_parameter() -> None:
    body, length = binary_request(X.astype(np.float32), "FP32", parameters={"timeout": 250_000})
    req = v2.decode_request(body, length, "input")
    assert req.x.dtype == np.float32 and req.timeout_s == 0.25


def test_timeout_0_is_no_timeout_of_the_requests_own_as_in_triton() -> None:
    # Triton reads parameters.timeout as uint64 microseconds, 0 meaning none of the request's
    # own; tritonclient sends infer(timeout=0) as it is. It was answered 400.
    body = json_request([1, 2, 3, 4], [1, 1, 2, 2], parameters={"timeout": 0})
    assert v2.decode_request(body, None, "input").timeout_s is None


@pytest.mark.parametrize(
    ("body", "length", "message"),
    [
        (b"{not json", None, "malformed JSON"),
        # raw bytes without the header that says so: that header is the fix, not "char 0"
        (
            bytes(4),
            None,
            re.escape(
                "malformed JSON: unexpected character, expected a JSON value: line 1 column 1 "
                "(char 0) (a body that is the input's raw UINT8 tensor needs the header "
                "Inference-Header-Content-Length: 0;"
            ),
        ),
        (b"\x89PNG\r\n\x1a\n", None, r"^malformed JSON: the body is not UTF-8 text \(a body that"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"inputs": []}', None, "exactly one input 'input'; got 0"),
        # the simple protocol's body sent to V2 infer: which format goes where
        (
            b'{"instances": [[[1, 2], [3, 4]]]}',
            None,
            re.escape(
                'the body has no "inputs" list (V2 format: {"inputs": [{"name": "input", '
                '"shape": [...], "datatype": "UINT8", "data": [...]}]}); for {"instances": '
                "[...]} use /v1/predict"
            )
            + "$",
        ),
        (b'{"id": "a"}', None, r'the body has no "inputs" list \(V2 format: .*\]}\)$'),
        (b'{"inputs": {"name": "input"}}', None, r"^inputs must be a list, got dict \(V2"),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2]).replace(b'"input"', b'"pixels"'),
            None,
            "unknown input 'pixels'",
        ),
        (json_request([1, 2, 3], [1, 1, 2, 2]), None, r"holds 4 values but data has 3"),
        (json_request([[1, 2], [3]], [1, 1, 2, 2]), None, "ragged"),
        (
            json_request([1.5, 2, 3, 4], [1, 1, 2, 2]),
            None,
            "fractional numbers but its datatype is UINT8",
        ),
        # above 255 only by its fraction: it was said to be out of range
        (
            json_request([255.4, 2, 3, 4], [1, 1, 2, 2]),
            None,
            "fractional numbers but its datatype is UINT8",
        ),
        (json_request(["a", "b", "c", "d"], [1, 1, 2, 2], "FP32"), None, "not numbers"),
        (
            json_request([1.5, 2, 3, 4], [1, 1, 2, 2], "INT64"),
            None,
            "fractional numbers but its datatype is INT64",
        ),
        # whole numbers written as JSON floats, and an integer just below INT64 that orjson
        # reads as the float -2**63: both were called fractional
        (
            json_request([1.0, 2, 3, 4], [1, 1, 2, 2]),
            None,
            re.escape(
                "input data holds 1.0, a JSON float (written with a point or an exponent, or an "
                "integer beyond 64 bits), but its datatype is UINT8: send integers"
            ),
        ),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2], "INT64").replace(
                b"[1, 2, 3, 4]", b"[1, 2, 3, -9223372036854775809]"
            ),
            None,
            re.escape("input data holds -9.223372036854776e+18, a JSON float"),
        ),
        # JSON true/false are Python ints: bytes() and numpy took them as pixels 1 and 0
        (
            json_request([True, False, True, True], [1, 1, 2, 2]),
            None,
            "input data holds true/false but its datatype is UINT8: send numbers",
        ),
        (
            json_request([[[[1.0, 2.0], [True, 3.0]]]], [1, 1, 2, 2], "FP32"),
            None,
            "holds true/false but its datatype is FP32",
        ),
        # deep nesting: the true/false check recursed into a RecursionError (a 500)
        (
            json_request([7], [1]).replace(b"[7]", b"[" * 330 + b"true" + b"]" * 330),
            None,
            "holds true/false",
        ),
        (
            json_request([7], [1]).replace(b"[7]", b"[" * 330 + b"7" + b"]" * 330),
            None,
            "nested too deep",
        ),
        # a JSON integer beyond 64 bits arrives as a float: it was called fractional
        (
            json_request([2**64, 0, 0, 0], [1, 1, 2, 2], "INT64"),
            None,
            re.escape(
                "input data value 1.8446744073709552e+19 is out of range for INT64 "
                "(-9223372036854775808..9223372036854775807)"
            ),
        ),
        (
            json_request([2**63, 0, 0, 0], [1, 1, 2, 2], "INT64"),
            None,
            re.escape("value 9223372036854775808 is out of range for INT64"),
        ),
        (
            json_request([0, 0, 0, -1], [1, 1, 2, 2]),
            None,
            re.escape("input data value -1 is out of range for UINT8 (0..255)"),
        ),
        (
            json_request([0, 70000, 0, 0], [1, 1, 2, 2], "FP16"),
            None,
            re.escape("input data value 70000 is out of range for FP16 (-65504.0..65504.0)"),
        ),
        (
            json_request([0, 0, 0, 0], [1, 1, 2, 2], "FP32").replace(b"[0, 0", b"[1e400, 0"),
            None,
            "malformed JSON: number is infinity when parsed as double",
        ),
        # json.dumps (tritonclient's encoder) writes non-finite floats as bare tokens
        (
            json_request([0, float("nan"), 0, 0], [1, 1, 2, 2], "FP32"),
            None,
            re.escape("the body contains NaN (line 1 column 86), which JSON does not allow"),
        ),
        (
            json_request([0, 0, float("-inf"), 0], [1, 1, 2, 2], "FP32"),
            None,
            re.escape("the body contains Infinity (line 1 column 90), which JSON does not allow"),
        ),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2], "BYTES"),
            None,
            "'BYTES' is not supported for pixels",
        ),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2], "FLOAT"),
            None,
            "'FLOAT' is not a known datatype",
        ),
        (json_request([1, 2, 3, 4], [1, -1, 2, 2]), None, "non-negative integers"),
        (json_request(5, [1, 1, 2, 2]), None, "must be a list of numbers"),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2], outputs=[{"name": "embedding"}]),
            None,
            "unknown output 'embedding'",
        ),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2], parameters={"timeout": -5}),
            None,
            re.escape("parameters.timeout must be microseconds (0: none), got -5"),
        ),
        (json_request([1, 2, 3, 4], [1, 1, 2, 2], id=7), None, "id must be a string"),
        (
            b'{"inputs": [{"name": "input", "shape": [1, 1, 2, 2], "datatype": "UINT8"}]}',
            None,
            "neither data nor",
        ),
        (
            b'{"inputs": [{"name": "input", "shape": [1,1,2,2], "datatype": "UINT8", "parameters": {"shared_memory_region": "r"}}]}',
            None,
            "shared memory",
        ),
        (binary_request(X)[0], "nine", r"must be the JSON header's length in bytes \(0 or more\)"),
        (binary_request(X)[0], "1_0", r"length in bytes \(0 or more\), got '1_0'"),
        (binary_request(X)[0], "-8", r"length in bytes \(0 or more\), got '-8'"),
        # a length that cuts the JSON short, or leaves some of it for the binary: orjson's "unexpected
        # end of data" / "unexpected content after document" said nothing of the header
        *(
            (
                binary_request(X)[0],
                str(int(binary_request(X)[1]) + d),
                rf"^malformed JSON: .* in the first {int(binary_request(X)[1]) + d} bytes, which "
                f"{v2.HEADER_LENGTH} says are the JSON header: set it to the JSON's length in bytes$",
            )
            for d in (-1, 1)
        ),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2], outputs=[{"name": "logits"}] * 2),
            None,
            "output 'logits' is asked for twice: ask once",
        ),
        (binary_request(X)[0], "100000", "but the body has"),
        # past Python's 4,300 digits int() raised ValueError: a 500
        (binary_request(X)[0], "9" * 5000, "is 9999999999999999999... but the body has"),
        (binary_request(X)[0][:-1], binary_request(X)[1], "needs 8 bytes"),
        (binary_request(X)[0] + b"\0", binary_request(X)[1], "needs 8 bytes"),
        # binary tensors after the JSON but no header to say where the JSON ends: orjson's
        # "unexpected content after document" (or "not valid UTF-8") said nothing of the header
        (binary_request(X)[0], None, f"{v2.HEADER_LENGTH} header"),
        (binary_request(X + 200)[0], None, f"{v2.HEADER_LENGTH} header"),
        # no body and no header: it said "Inference-Header-Content-Length is 0, so ..."
        (b"", None, r'^the body is empty: send an infer request \(\{"inputs": \[\{"name": "input"'),
        (
            json_request([1, 2, 3, 4], [1, 1, 2, 2]) + b"\0\0",
            str(len(json_request([1, 2, 3, 4], [1, 1, 2, 2]))),
            "no input has binary_data_size",
        ),
    ],
)
def test_bad_requests_say_what_is_wrong(body: bytes, length: str | None, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        v2.decode_request(body, length, "input")
    assert info.value.status == 400


def test_a_raw_tensor_body_is_the_input_with_every_output_binary() -> None:
    req = v2.decode_request(X.tobytes(), "0", "input", chw=(1, 2, 2), max_rows=2)
    np.testing.assert_array_equal(req.x, X)
    assert [(o.name, o.binary) for o in req.outputs] == [("logits", True), ("probabilities", True)]
    assert req.id is None and req.timeout_s is None
    with pytest.raises(TooManyRows):
        v2.decode_request(X.tobytes() * 2, "0", "input", chw=(1, 2, 2), max_rows=2)
    for body in (b"", X.tobytes()[:-1]):
        with pytest.raises(ProtocolError, match="is 0, so the body is the input tensor"):
            v2.decode_request(body, "0", "input", chw=(1, 2, 2))


def test_json_data_at_the_limits_of_its_datatype_is_taken_as_sent() -> None:
    cases = [
        ([2**63 - 1, -(2**63), 0, 1], "INT64", np.int64),
        ([2**64 - 1, 0, 0, 1], "UINT64", np.uint64),
        ([255, 0, 0, 1], "UINT8", np.uint8),
        ([-65504.0, 65504, 0, 1], "FP16", np.float64),
    ]
    for data, datatype, kind in cases:
        # "true" elsewhere in the body (an output parameter) is no boolean in the data
        body = json_request(data, [1, 1, 2, 2], datatype, parameters={"binary_data_output": True})
        x = v2.decode_request(body, None, "input").x
        assert x.dtype == kind and x.ravel().tolist() == data


def test_no_outputs_named_asks_for_all_of_them_as_in_triton() -> None:
    for body in (
        json_request([1, 2, 3, 4], [1, 1, 2, 2]),
        json_request([1, 2, 3, 4], [1, 1, 2, 2], outputs=[]),
    ):
        req = v2.decode_request(body, None, "input")
        assert [o.name for o in req.outputs] == ["logits", "probabilities"], body


def test_json_response_carries_id_values_and_probabilities() -> None:
    logits = np.array([[10.0, 90.0], [0.0, 0.0]], np.float32)
    outputs = [RequestedOutput("logits", False), RequestedOutput("probabilities", False)]
    body, headers = v2.encode_response(logits, outputs, ["bright", "dark"], "m", "abc")
    assert headers == {"content-type": "application/json"}
    doc = json.loads(body)
    assert doc["id"] == "abc" and doc["model_name"] == "m" and doc["model_version"] == "1"
    out = {o["name"]: o for o in doc["outputs"]}
    assert out["logits"] == {
        "name": "logits",
        "datatype": "FP32",
        "shape": [2, 2],
        "data": [10.0, 90.0, 0.0, 0.0],
    }
    np.testing.assert_allclose(
        out["probabilities"]["data"], [1.8048514e-35, 1.0, 0.5, 0.5], rtol=1e-6
    )


def test_binary_response_layout_and_classification_strings() -> None:
    logits = np.array([[3.0, 1.0, 2.0]], np.float32)
    outputs = [RequestedOutput("logits", True), RequestedOutput("logits", True, classification=2)]
    body, headers = v2.encode_response(logits, outputs, ["a", "b", "c"], "m", None)
    n = int(headers["inference-header-content-length"])
    header = json.loads(body[:n])
    assert "id" not in header
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    raw = body[n:]
    assert len(raw) == sum(sizes) and sizes[0] == 12
    np.testing.assert_array_equal(np.frombuffer(raw[:12], "<f4"), [3.0, 1.0, 2.0])
    strings, rest = [], raw[12:]
    while rest:
        (size,) = struct.unpack("<I", rest[:4])
        strings.append(rest[4 : 4 + size].decode())
        rest = rest[4 + size :]
    assert strings == ["3.000000:0:a", "2.000000:2:c"]  # best first, Triton's format
    assert header["outputs"][1]["datatype"] == "BYTES" and header["outputs"][1]["shape"] == [1, 2]


def test_model_metadata_shape_has_a_dynamic_batch() -> None:
    meta = v2.model_metadata("m", "onnxruntime_onnx", "input", (1, 28, 28), ["x", "y"], 32)
    assert meta["inputs"] == [{"name": "input", "datatype": "UINT8", "shape": [-1, 1, 28, 28]}]
    assert meta["outputs"][0] == {"name": "logits", "datatype": "FP32", "shape": [-1, 2]}
    assert meta["parameters"] == {"labels": ["x", "y"], "max_batch_size": 32}


def test_model_config_in_tritons_form() -> None:
    config = v2.model_config("m", "pytorch_libtorch", "input", (3, 8, 8), 5, 16, 2.5, 2, True)
    assert config["max_batch_size"] == 16 and config["backend"] == "pytorch"
    assert config["input"] == [
        {"name": "input", "data_type": "TYPE_UINT8", "format": "FORMAT_NCHW", "dims": [3, 8, 8]}
    ]
    assert config["output"][1] == {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [5]}
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 2500}
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_GPU"}]


def test_v1_instances_and_predictions() -> None:
    x, k = v1.decode_instances(b'{"instances": [[[1, 2], [3, 4]]], "top_k": 1}', (1, 2, 2), 5)
    assert x.shape == (1, 1, 2, 2) and k == 1  # [H][W] is fine for one channel
    # null is no top_k, as V2 reads a null parameter
    _, k = v1.decode_instances(b'{"instances": [[[1, 2], [3, 4]]], "top_k": null}', (1, 2, 2), 5)
    assert k == 5
    body = v1.encode_predictions(np.array([[0.0, 2.0]], np.float32), ["a", "b"], 5, "m")
    (pred,) = json.loads(body)["predictions"]
    assert pred["label"] == "b" and pred["index"] == 1
    assert pred["score"] == pytest.approx(1 / (1 + np.exp(-2)))
    assert [p["label"] for p in pred["top_k"]] == ["b", "a"]  # k clipped to the classes


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"instances": [}', "malformed JSON"),
        # an image sent here, as the body or as a form: where it goes, not "surrogates"
        (
            b"\x89PNG\r\n\x1a\n",
            re.escape(
                'malformed JSON: the body is not UTF-8 text: send {"instances": [image, ...]} '
                "here; image files (PNG, JPEG) go to /v1/predict/image as multipart form field "
                '"files"'
            )
            + "$",
        ),
        (b"--x\r\nContent-Disposition: form-data", "go to /v1/predict/image as multipart"),
        (b'{"instances": [[[[0, NaN]]]]}', r"contains NaN \(line 1 column 22\).*finite numbers"),
        # {} is a JSON object: it said "body must be a JSON object {"instances": ...}"
        (b'{"images": []}', re.escape('the body has no "instances": send {"instances": [image')),
        (b"{}", '^the body has no "instances"'),
        (b"[[1, 2], [3, 4]]", re.escape('the body is a JSON array: send {"instances": [image')),
        (b"null", re.escape('the body is a JSON null: send {"instances": [image')),
        (b"true", "^the body is a JSON boolean: "),
        (b'"x"', "^the body is a JSON string: "),
        (b"7", "^the body is a JSON number: "),
        (b'{"instances": []}', "empty batch"),
        (b'{"instances": [[[1, 2], [3]]]}', "ragged"),
        (b'{"instances": [[["a", "b"], ["c", "d"]]]}', "numbers"),
        (b'{"instances": [[1, 2, 3, 4]]}', r"must be \[1, 2, 2\]"),
        (
            b'{"instances": [[[[1, 2, 3], [4, 5, 6], [7, 8, 9]]]]}',
            r"must be \[1, 2, 2\] pixels; got instances of shape \[1, 3, 3\]$",
        ),
        # channels last, as PIL and numpy images come: said so
        (
            b'{"instances": [[[[1], [2]], [[3], [4]]]]}',
            re.escape(
                "each instance must be [1, 2, 2] pixels; got instances of shape [2, 2, 1] "
                "(this looks like HWC: transpose each to CHW)"
            ),
        ),
        (
            b'{"inputs": [{"name": "input"}]}',
            re.escape('a V2 body ({"inputs": [...]}) goes to /v2/models/{name}/infer'),
        ),
        (b'{"instances": [[[1, 2], [3, 4]]], "top_k": 0}', "top_k"),
        (b'{"instances": [[[1, 2], [3, true]]]}', "instances hold true/false"),
    ],
)
def test_v1_bad_requests(body: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        v1.decode_instances(body, (1, 2, 2), 5)


TOO_MANY = "request has 5 rows; this server takes at most 4 per request: split it"


def test_more_instances_than_a_batch_takes_are_refused_before_numpy_reads_them() -> None:
    """The batcher's refusal (413, its words), from the first instance: numpy would build the
    whole array first. The rest is never read: a ragged one after it is not what is said."""
    image = [[1, 2], [3, 4]]
    body = json.dumps({"instances": [image] * 4 + [[[1]]]}).encode()
    with pytest.raises(TooManyRows, match=f"^{TOO_MANY}$"):
        v1.decode_instances(body, (1, 2, 2), 5, max_rows=4)
    with pytest.raises(ProtocolError, match="ragged"):  # within the limit: read, and ragged
        v1.decode_instances(body, (1, 2, 2), 5, max_rows=5)
    # instances of the wrong shape are said to be, as within the limit
    hwc = json.dumps({"instances": [[[[1], [2]], [[3], [4]]]] * 5}).encode()
    with pytest.raises(ProtocolError, match=re.escape("shape [2, 2, 1] (this looks like HWC")):
        v1.decode_instances(hwc, (1, 2, 2), 5, max_rows=4)


def test_a_v2_batch_over_the_limit_is_refused_before_its_json_data_is_read() -> None:
    short = json_request([1, 2, 3], [5, 1, 2, 2])  # the data would be 400: 3 values, not 20
    with pytest.raises(TooManyRows, match=f"^{TOO_MANY}$"):
        v2.decode_request(short, None, "input", max_rows=4)
    with pytest.raises(ProtocolError, match="holds 20 values but data has 3"):
        v2.decode_request(short, None, "input", max_rows=5)
    one_image = json_request(list(range(20)), [5, 2, 2])  # 3-D: one image of 5 channels
    assert v2.decode_request(one_image, None, "input", max_rows=4).x.shape == (5, 2, 2)


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        (
            [10**12, 1, 28, 28],
            TooManyRows,
            "request has 1000000000000 rows; this server takes at most 64 per request: split it",
        ),
        (
            [1, 10**12, 28, 28],
            ProtocolError,
            "input shape [1, 1000000000000, 28, 28] is too large to be an image batch "
            "(over 1,099,511,627,776 values): send [N, C, H, W]",
        ),
        (
            [1] * 9,
            ProtocolError,
            "input shape [1, 1, 1, 1, 1, 1, 1, 1, 1] is not an image batch: send [N, C, H, W]",
        ),
        (  # an integer JSON's parser reads as a float: not "must be integers"
            [1, 1, 28, 10**23],
            ProtocolError,
            "input shape [1, 1, 28, 1e+23] is too large to be an image batch "
            "(over 1,099,511,627,776 values): send [N, C, H, W]",
        ),
    ],
)
def test_an_absurd_shape_is_said_to_be_what_it_is(
    shape: list[int], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        v2.decode_request(json_request([0] * 784, shape), None, "input", max_rows=64)


def encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def encode_exif(image: Image.Image, fmt: str, exif: Image.Exif) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, exif=exif)
    return buf.getvalue()


def test_images_are_converted_to_the_input_spec() -> None:
    gray = Image.fromarray(np.array([[0, 50], [100, 250]], np.uint8), "L")
    np.testing.assert_array_equal(
        v1.decode_image(encode(gray, "PNG"), (1, 2, 2)), [[[0, 50], [100, 250]]]
    )
    rgb = Image.new("RGB", (2, 2), (255, 0, 0))  # red -> luma 76 (ITU-R 601-2, as Pillow does)
    np.testing.assert_array_equal(
        v1.decode_image(encode(rgb, "PNG"), (1, 2, 2)), np.full((1, 2, 2), 76)
    )
    big = Image.new("L", (64, 48), 200)
    assert v1.decode_image(encode(big, "JPEG"), (3, 8, 8)).shape == (3, 8, 8)


def test_16_bit_phone_and_rotated_images_decode_as_seen() -> None:
    # 16-bit gray 1000/65535 is ~1.5 % gray: 4 in 8 bits (Pillow's convert would clip to 255)
    deep = Image.fromarray(np.full((2, 2), 1000, np.uint16))
    np.testing.assert_array_equal(
        v1.decode_image(encode(deep, "PNG"), (1, 2, 2)), np.full((1, 2, 2), 4)
    )
    # MPO: a JPEG with a second picture appended, as many phone cameras write
    buf = io.BytesIO()
    red = Image.new("RGB", (8, 8), (200, 0, 0))
    red.save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (8, 8))])
    pixels = v1.decode_image(buf.getvalue(), (3, 8, 8))
    assert abs(int(pixels[0].mean()) - 200) < 8 and pixels[1:].mean() < 8
    # EXIF orientation 6 (stored sideways, shown rotated 90° clockwise): the left half white
    # as stored is the top half as seen
    stored = Image.new("L", (16, 8), 0)
    stored.paste(255, (0, 0, 8, 8))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, "JPEG", exif=exif, quality=95)
    seen = v1.decode_image(buf.getvalue(), (1, 16, 8))[0]
    assert seen[:8].mean() > 240 and seen[8:].mean() < 15


def test_every_exif_orientation_is_turned_upright_as_pillow_does() -> None:
    stored = Image.fromarray((np.arange(8 * 12, dtype=np.uint8) * 2).reshape(8, 12), "L")
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        png = encode_exif(stored, "PNG", exif)
        seen = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(png))))
        np.testing.assert_array_equal(v1.decode_image(png, (1, *seen.shape))[0], seen)


def test_an_exif_tag_pillow_cannot_write_back_does_not_break_decoding() -> None:
    # Orientation 6, then tag 0x0143 (TileWidth) stored as ASCII: ImageOps.exif_transpose
    # raised struct.error rewriting it, which the server answered with a 500.
    tiff = (
        b"MM\x00\x2a\x00\x00\x00\x08\x00\x02"
        + b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00"
        + b"\x01\x43\x00\x02\x00\x00\x00\x04cam\x00\x00\x00\x00\x00"
    )
    app1 = b"\xff\xe1" + (len(tiff) + 8).to_bytes(2, "big") + b"Exif\x00\x00" + tiff
    stored = Image.new("L", (16, 8), 0)
    stored.paste(255, (0, 0, 8, 8))  # left half white as stored: top half as seen
    jpeg = encode(stored, "JPEG")
    seen = v1.decode_image(jpeg[:2] + app1 + jpeg[2:], (1, 16, 8))[0]
    assert seen[:8].mean() > 240 and seen[8:].mean() < 15


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_damaged_exif_orientation_is_a_400_and_other_damage_stays_out_of_the_log(
    fmt: str, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow skips a damaged EXIF tag with a warning: the orientation skipped, the image was
    taken unturned, and each kind of damage wrote two raw lines to the server's log."""

    def tiff(make_count: int, orientation_count: int) -> bytes:  # Make, then Orientation 6
        return (
            b"MM\x00\x2a\x00\x00\x00\x08\x00\x02"
            + b"\x01\x0f\x00\x02" + make_count.to_bytes(4, "big") + b"\x00\x00\x00\x26"
            + b"\x01\x12\x00\x03" + orientation_count.to_bytes(4, "big") + b"\x00\x06\x00\x00"
            + b"\x00\x00\x00\x00cam\x00"
        )  # fmt: skip

    stored = Image.new("L", (16, 8), 0)
    stored.paste(255, (0, 0, 8, 8))  # left half white as stored: top half as seen

    def image(exif: bytes) -> bytes:
        buf = io.BytesIO()
        stored.save(buf, fmt, exif=b"Exif\x00\x00" + exif)
        return buf.getvalue()

    seen = v1.decode_image(image(tiff(4, 1)), (1, 16, 8), "x")[0]  # whole: turned upright
    assert seen[:8].mean() > 240 and seen[8:].mean() < 15
    # the Make tag's data past the end of the block: skipped, the orientation still read
    seen = v1.decode_image(image(tiff(0xFFFF, 1)), (1, 16, 8), "x")[0]
    assert seen[:8].mean() > 240 and seen[8:].mean() < 15
    # a whole table with no orientation (upright), then no next-IFD offset: Pillow reads every
    # tag and warns of the missing offset, which loses nothing
    whole = b"MM\x00\x2a\x00\x00\x00\x08\x00\x01\x01\x0f\x00\x02\x00\x00\x00\x04cam\x00"
    seen = v1.decode_image(image(whole), (1, 8, 16), "x")[0]
    assert seen[:, :8].mean() > 240 and seen[:, 8:].mean() < 15  # as stored
    if fmt == "PNG":  # the same block as ImageMagick writes it, in a hex text chunk
        text = PngImagePlugin.PngInfo()
        hexed = (b"Exif\x00\x00" + whole).hex()
        text.add_text("Raw profile type exif", f"\nexif\n{len(whole) + 6}\n{hexed}\n", zip=True)
        buf = io.BytesIO()
        stored.save(buf, "PNG", pnginfo=text)
        seen = v1.decode_image(buf.getvalue(), (1, 8, 16), "x")[0]
        assert seen[:, :8].mean() > 240 and seen[:, 8:].mean() < 15
    else:  # no EXIF, and a damaged MPO index, which Pillow's EXIF parser reads too
        index = b"II*\x00\x08\x00\x00\x00\x01\x00\x00\xb0\x07\x00\x04\x00\x00\x000100"
        buf = io.BytesIO()
        stored.save(buf, "JPEG")
        app2 = b"\xff\xe2" + struct.pack(">H", len(index) + 6) + b"MPF\x00" + index
        monkeypatch.setattr(images, "_PASSED_ON", set())  # none passed on in this process yet
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            for _ in range(3):  # Pillow's "malformed MPO", passed on once, not once an upload
                jpeg = buf.getvalue()[:2] + app2 + buf.getvalue()[2:]
                seen = v1.decode_image(jpeg, (1, 8, 16))[0]
                assert seen[:, :8].mean() > 240 and seen[:, 8:].mean() < 15
        assert len([w for w in shown if "malformed MPO" in str(w.message)]) == 1
    # the orientation's own data past the end: skipped, so which way is up is unknown
    with pytest.raises(
        ProtocolError, match=r"x: its EXIF orientation is unreadable \(Tag data"
    ) as info:
        v1.decode_image(image(tiff(4, 0xFFFF)), (1, 16, 8), "x")
    assert info.value.status == 400
    assert not [w for w in recwarn if "TiffImagePlugin" in w.filename]


def test_exif_pillow_cannot_read_is_a_400_naming_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(self: Image.Image) -> Image.Exif:
        raise struct.error("unpack requires a buffer of 4 bytes")

    monkeypatch.setattr(Image.Image, "getexif", unreadable)
    with pytest.raises(ProtocolError, match=r"x.jpg: its EXIF metadata is unreadable") as info:
        v1.decode_image(encode(Image.new("L", (2, 2)), "JPEG"), (1, 2, 2), "x.jpg")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("data", "status", "message"),
    [
        (b"\x89PNG\r\n\x1a\n garbage", 400, "not a readable"),
        (
            b"not an image at all",
            400,
            r"x.png: not a readable PNG or JPEG image \(unrecognised data\)",
        ),
        (b"", 400, "not a readable"),
        (encode(Image.new("L", (2, 2)), "GIF"), 415, "GIF images are not accepted"),
        (encode(Image.new("L", (2, 2)), "PNG")[:40], 400, "not a readable"),
        # pixels cut short: Pillow says so only when it decodes them, which reading EXIF does
        (
            encode(Image.effect_noise((64, 64), 64).convert("L"), "PNG")[:-30],
            400,
            r"x.png: not a readable PNG or JPEG image \(image file is truncated",
        ),
    ],
)
def test_bad_images(data: bytes, status: int, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        v1.decode_image(data, (1, 2, 2), "x.png")
    assert info.value.status == status


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (None, 5),
        ("", 5),
        ("top_k=2", 2),
        ("other=1&top_k=3", 3),
        ("top_k=0", "top_k must be a positive integer, got '0'"),
        ("top_k=1_0", "top_k must be a positive integer, got '1_0'"),
        ("top_k=" + "9" * 5000, "top_k must be a positive integer, got '999"),
        ("top_k=0000000002", 2),  # as the body takes any count, and the image route this
        ("top_k=9999999999", 9999999999),
        ("top_k=2&top_k=3", "top_k is given 2 times in the query: give it once"),
    ],
)
def test_v1_top_k_may_come_in_the_query_as_on_the_image_route(
    query: str | None, expected: int | str
) -> None:
    """/v1/predict?top_k=2 was ignored without a word: the image route takes it so."""
    if isinstance(expected, int):
        assert v1.query_top_k(query, 5) == expected
    else:
        with pytest.raises(ProtocolError, match="^" + re.escape(expected)):
            v1.query_top_k(query, 5)
