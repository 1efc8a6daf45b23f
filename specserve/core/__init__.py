"""The speculative-decoding core: pure algorithms over tensors, no I/O, no services."""
