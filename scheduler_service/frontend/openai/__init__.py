"""The OpenAI-compatible HTTP API: an adapter over GenerationServicer.generate (see app.py)."""
