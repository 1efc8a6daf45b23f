"""What the three gRPC services share: settings, status mapping, server bootstrap, conversions,
telemetry. Torch-free, so the router can use all of it."""
