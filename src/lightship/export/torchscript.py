"""TorchScript: trace (script when tracing cannot follow the model's control flow)."""

from __future__ import annotations

import io
import json
import logging
import pickletools
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from lightship.export.failure import reason, warn_frozen
from lightship.runtime.base import META_FILE

log = logging.getLogger(__name__)


# The name torch gives a class type traced again under a name it already holds: its number
# counts every type made in the process, so a model traced twice in one (a notebook) got other
# names, other bytes and another sha256 in the manifest, which then dropped the report.
MANGLED = re.compile(rb"___torch_mangle_([0-9]+)")


def save(module: torch.jit.ScriptModule, path: Path, extra: dict[str, str]) -> None:
    """`torch.jit.save` less its `.debug_pkl` records, with its mangled class names numbered
    from 0 (`canonical_names`). Those records map the code to the Python stack it was traced
    or scripted from: absolute paths of torch's, lightship's and the model's files and their
    line numbers, which would make the file's bytes (its sha256 in the manifest) change with
    the install path and any edit to those files. TorchScript loads without them; its runtime
    errors then name no Python source line. Written through a file object: given a path,
    torch names the archive's top folder after the file, here a random temporary name."""
    buffer = io.BytesIO()
    torch.jit.save(module, buffer, _extra_files=extra)
    buffer.seek(0)
    reader = torch._C.PyTorchFileReader(buffer)
    records = {
        name: reader.get_record(name)
        for name in reader.get_all_records()
        if not name.endswith(".debug_pkl")
    }
    with open(path, "wb") as fh:
        writer = torch._C.PyTorchFileWriter(fh)  # torch's own zip writer, as torch.jit.save's
        for name, data in canonical_names(records).items():
            writer.write_record(name, data, len(data))
        writer.write_end_of_file()


def canonical_names(records: dict[str, bytes]) -> dict[str, bytes]:
    """The archive's records with each `___torch_mangle_N` renumbered in order of first use
    (the pickled module first, then the code), so that the file's bytes do not depend on what
    the process traced before. Renamed only in the code and where the pickles name a class
    (their GLOBAL opcodes, text ended by a newline, whose length nothing records); records
    that name one anywhere else are left as torch wrote them. `export` loads and checks the
    file it wrote, renamed or not."""
    text = [name for name in records if name.endswith(".pkl") or name.startswith("code/")]
    numbers: dict[bytes, bytes] = {}
    for name in sorted(text, key=lambda name: name != "data.pkl"):  # stable: torch's order
        for found in MANGLED.finditer(records[name]):
            numbers.setdefault(found.group(1), str(len(numbers)).encode())
    if all(old == new for old, new in numbers.items()):
        return records
    for name in text:
        if name.endswith(".pkl") and not _only_in_globals(records[name]):
            return records

    def renumbered(text: bytes) -> bytes:
        return MANGLED.sub(lambda m: b"___torch_mangle_" + numbers[m.group(1)], text)

    renamed: dict[str, bytes] = {}
    for name, data in records.items():
        if name in text:
            name, data = renumbered(name.encode()).decode(), renumbered(data)
        renamed[name] = data
    return renamed


def _only_in_globals(pickled: bytes) -> bool:
    """Whether every mangled name in a pickle is in a GLOBAL opcode's text."""
    in_globals = 0
    try:
        for op, arg, _ in pickletools.genops(pickled):
            if op.name == "GLOBAL":
                in_globals += len(MANGLED.findall(str(arg).encode()))
    except Exception:  # not a pickle these tools read: left alone
        return False
    return in_globals == len(MANGLED.findall(pickled))


def write(
    model: torch.nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str]
) -> dict[str, Any]:
    # torch 2.13 marks torch.jit deprecated; the artifact is still asked for and still loads in
    # C++ (libtorch) without Python. torch.export's .pt2 is the forward path.
    model = model.eval()
    method = "trace"
    try:
        with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = torch.jit.trace(model, example, check_inputs=[(example[:1],), (example,)])
        warn_frozen(log, caught, "torch.jit.trace", len(example))
    except Exception as exc:
        log.warning("torch.jit.trace failed (%s); scripting instead", reason(exc))
        method = "script"
        module = torch.jit.script(model)
    module = torch.jit.freeze(module.eval()) if method == "trace" else module
    save(module, path, {META_FILE: json.dumps(meta)})
    return {"method": method}
