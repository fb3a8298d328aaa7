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


def strip_paths(program: torch.export.ExportedProgram) -> None:
    """Drop each node's `stack_trace`: the Python stack it was traced from, absolute paths of
    torch's and the model's files and their line numbers, which would make the file's bytes
    (its sha256 in the manifest) change with the install path and any edit to those files.
    `nn_module_stack` still names the module each node came from."""
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.meta.pop("stack_trace", None)


def write(
    model: torch.nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str]
) -> dict[str, Any]:
    batch = torch.export.Dim("batch")
    with printout_on_failure_to_debug(log, "torch.export"):
        program = torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))
    strip_paths(program)
    # Saved through a file object: given a path, torch names the archive's top folder after
    # the file, here a random temporary name.
    with open(path, "wb") as fh:
        torch.export.save(program, fh, extra_files={META_FILE: json.dumps(meta)})
    return {"torch_export": True}
