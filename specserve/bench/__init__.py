"""Benchmark harness: MT-Bench-style prompts, interleaved runs of every method, tables and plots.

Submodules are imported on demand (`specserve.bench.cli`, `.prompts`, `.runner`, `.report`) so that
`specserve --help` does not pay for matplotlib or torch.
"""
