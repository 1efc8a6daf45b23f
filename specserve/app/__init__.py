"""The application layer: command-line wiring of whole processes (`specserve serve`, `specserve stack`).

Dependencies point one way: specserve.cli and specserve.app -> services -> specserve.engine / methods ->
runtime, glide -> core. Only this layer (and specserve.cli) imports the `services` packages.
"""
