"""Helpers shared by the test layers and the benchmarks (not test modules).

- ``redis_servers``: real redis-server processes and the Redis fixtures;
- ``tcp_proxy``: a loopback proxy that drops, delays or cuts a link;
- ``reference``: a plain-Python model of the limiter to compare answers with.
"""
