"""Transport: socket factory, typed wire messages, zero-copy array codec."""
