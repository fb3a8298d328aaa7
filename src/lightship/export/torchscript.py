"""TorchScript: trace (script when tracing cannot follow the model's control flow)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from lightship.export.failure import reason
from lightship.runtime.base import META_FILE

log = logging.getLogger(__name__)


def write(
    model: torch.nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str]
) -> dict[str, Any]:
    # torch 2.13 marks torch.jit deprecated; the artifact is still asked for and still loads in
    # C++ (libtorch) without Python. torch.export's .pt2 is the forward path.
    model = model.eval()
    method = "trace"
    try:
        with torch.inference_mode():
            module = torch.jit.trace(model, example, check_inputs=[(example[:1],), (example,)])
    except Exception as exc:
        log.warning("torch.jit.trace failed (%s); scripting instead", reason(exc))
        method = "script"
        module = torch.jit.script(model)
    module = torch.jit.freeze(module.eval()) if method == "trace" else module
    torch.jit.save(module, str(path), _extra_files={META_FILE: json.dumps(meta)})
    return {"method": method}
