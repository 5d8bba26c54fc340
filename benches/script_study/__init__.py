"""Design study for a cheaper bucket.lua: where the server's time goes.

    python -m benches.script_study          # from the repository root; about a minute
    python -m benches.script_study --quick

``current.lua`` is a copy of python/bucketlimit/_redis/bucket.lua as it was when
the study was made (commit 64c3d68), ``variants/*.lua`` are candidate rewrites,
``pieces.py`` the script's parts on their own; ``study.py`` times them all on one
redis-server of our own (``INFO commandstats``, benches/server_stats.py), checks
that every variant answers exactly like the current script on random traces, and
prints the tables FINDINGS.md quotes. A measurement, never a test.
"""
