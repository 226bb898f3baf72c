"""Benchmark harness (jaxinfer bench SUITE)."""
