"""Export the best checkpoint to ONNX, TorchScript and torch.export (.pt2), each parity-checked.

`export(run, formats)` rebuilds the model from `best.ckpt` alone (never the training config or
`lightship.train`), writes each artifact to a temporary file, checks it against eager on the
held-out test split, and only then renames it into `RUN/export/` and records it in the manifest.
"""

from lightship.export.core import FORMATS, VARIANT_OF, Artifact, export

__all__ = ["FORMATS", "VARIANT_OF", "Artifact", "export"]
