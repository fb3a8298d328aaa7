"""Post-training int8 quantization (ONNX Runtime) and quantization-aware training (torchao).

Importing this package is light: the ISA check in `lightship.quantize.isa` is used by the
server, which must not import torch or the ONNX quantization tools.
"""
