"""lightship: train, export, quantize and serve image classifiers."""

__version__ = "0.1.0"
