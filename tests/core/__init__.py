"""The in-process limiter: its properties, threads, memory, bad input, scenarios, the CLI.

Nothing here needs Redis or imports a Redis client.
"""
