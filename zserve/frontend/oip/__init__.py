"""The Open Inference Protocol (KServe v2, Triton's flavour).

Its HTTP/REST and gRPC servers, their tensors, and the bridge into the frontend core.
"""
