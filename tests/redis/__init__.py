"""Everything that needs a real redis-server (started by the tests themselves)."""
