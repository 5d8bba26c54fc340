"""Small apps the real-server tests run in a subprocess."""
