"""minillm: a small, readable, tested LLM inference engine, built chapter by chapter.

Every idea the book teaches lives here once, in its finished form; the notebooks import it.
"""

__version__ = "0.1.0"
