"""TorchScript: trace (script when tracing cannot follow the model's control flow)."""

from __future__ import annotations

import io
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from lightship.export.failure import reason, warn_frozen
from lightship.runtime.base import META_FILE

log = logging.getLogger(__name__)


def save(module: torch.jit.ScriptModule, path: Path, extra: dict[str, str]) -> None:
    """`torch.jit.save` less its `.debug_pkl` records. They map the code to the Python stack it
    was traced or scripted from: absolute paths of torch's, lightship's and the model's files
    and their line numbers, which would make the file's bytes (its sha256 in the manifest)
    change with the install path and any edit to those files. TorchScript loads without them;
    its runtime errors then name no Python source line. Written through a file object: given
    a path, torch names the archive's top folder after the file, here a random temporary
    name."""
    buffer = io.BytesIO()
    torch.jit.save(module, buffer, _extra_files=extra)
    buffer.seek(0)
    reader = torch._C.PyTorchFileReader(buffer)
    with open(path, "wb") as fh:
        writer = torch._C.PyTorchFileWriter(fh)  # torch's own zip writer, as torch.jit.save's
        for name in reader.get_all_records():
            if not name.endswith(".debug_pkl"):
                data = reader.get_record(name)
                writer.write_record(name, data, len(data))
        writer.write_end_of_file()


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
