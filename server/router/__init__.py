"""Chapter 17's router, ``python -m server.router``: a proxy with the same API in front of
several servers, free of torch and of the engine; ``python -m server.router.bench`` measures it.
"""
