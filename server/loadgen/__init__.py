"""Chapter 11's load generator, ``python -m server.loadgen``: free of torch and of the engine,
so it measures any OpenAI-compatible server."""
