"""The HTTP side of minillm: the OpenAI-compatible streaming server, its load generator and
dashboard (chapters 9 and 10). It owns no model logic: everything it serves comes from the
engine in :mod:`minillm`, and nothing in :mod:`minillm` imports it.
"""
