"""The web integrations: HTTP helpers, Flask, FastAPI, uvicorn workers."""
