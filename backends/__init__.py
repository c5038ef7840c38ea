"""Backends: executors (ONNX Runtime, emulated), the backend process, the profiler."""
