"""Helpers for tests and benchmarks that need real services (e.g. an S3-compatible server)."""
