"""torch.export (.pt2): an ExportedProgram with a dynamic batch dimension."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from lightship.export.failure import printout_on_failure_to_debug
from lightship.runtime.base import META_FILE

log = logging.getLogger(__name__)


def write(
    model: torch.nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str]
) -> dict[str, Any]:
    batch = torch.export.Dim("batch")
    with printout_on_failure_to_debug(log, "torch.export"):
        program = torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path), extra_files={META_FILE: json.dumps(meta)})
    return {"torch_export": True}
