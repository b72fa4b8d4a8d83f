"""The HTTP side of minillm: an OpenAI-compatible streaming server over the engine.

It owns no model logic; chapter 9 builds it on :mod:`minillm`'s engine. Until then this
package holds only what the server will share with the load generator and dashboard.
"""
