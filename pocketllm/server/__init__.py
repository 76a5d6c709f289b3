"""The OpenAI-compatible HTTP server and the asynchronous front of the engine it drives."""
