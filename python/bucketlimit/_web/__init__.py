"""The framework-free layer of the web adapters: nothing here imports a web framework."""

from __future__ import annotations
