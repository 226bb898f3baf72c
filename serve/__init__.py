"""gRPC streaming service."""
