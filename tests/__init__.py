"""The test suite, by layer: core/, redis/, web/; shared helpers in support/.

A package, so layers import the helpers as ``tests.support.*`` (pytest puts the
repository root on ``sys.path``; so does ``python -m`` from the root).
"""
