"""specserve: lossless speculative decoding, in-process or as distributed services."""

__version__ = "0.1.0"
