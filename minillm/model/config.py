"""The model's shape as a small dataclass, and the named sizes the book uses.

A preset is plain data: pick a model by name (``get_preset("cpu")``) the way minGPT names
``gpt-nano`` and ``gpt-mini``. Every size shares GPT-2's tokenizer, so ``vocab_size`` is 50,257.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minillm.data.tokenizer import N_VOCAB


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a GPT-2-architecture decoder."""

    vocab_size: int = N_VOCAB
    context_length: int = 256  # the most positions the model has embeddings for
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # A test fixture: builds in milliseconds, trains a few steps in seconds.
    "tiny": ModelConfig(context_length=64, d_model=64, n_layers=2, n_heads=4),
    # The book's default on a laptop CPU: trains in about ten minutes on two cores. Most of
    # its 11.5M parameters are the 50,257 x 192 embedding; the four blocks hold 1.8M.
    "cpu": ModelConfig(context_length=256, d_model=192, n_layers=4, n_heads=4),
    # Chapter 15's draft model, trained on the same corpus and tokenizer as "cpu". A decode
    # step's cost is reading the weights, and the 50,257-row output matrix dominates them, so
    # the lever that makes a draft cheap is d_model (a third of cpu's: a third of the bytes),
    # not its layer count. 3.3M parameters, 97% of them the tied embedding.
    "draft": ModelConfig(context_length=256, d_model=64, n_layers=2, n_heads=4),
    # The book's model for a GPU: 51M parameters, half of them the tied embedding.
    "tinystories-50m": ModelConfig(context_length=512, d_model=512, n_layers=8, n_heads=8),
}

# Not a preset (nothing here trains it): the shape of a 7B model such as Llama-2-7B (32 layers
# of width 4096, 32 heads, a 32,000-token vocabulary, 4,096-token context) in our GPT's blocks,
# for the what-if arithmetic of chapters 1, 5 and 6, which ask how a real model's costs compare.
SEVEN_B = ModelConfig(vocab_size=32000, context_length=4096, d_model=4096, n_layers=32, n_heads=32)


def get_preset(name: str) -> ModelConfig:
    """A preset by name, or an error that lists the names there are."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
