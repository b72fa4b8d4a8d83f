"""From logits to text (chapters 5, 6 and 10): what every generator, naive or paged, shares.

- ``sampling``: ``SamplingParams`` and the sampler (greedy, temperature, top-k, top-p, seeds).
- ``generate``: the naive loop, the contiguous KV cache and static batches (chapters 5 and 6).
- ``detokenizer``: tokens to text incrementally, UTF-8-safe and stop-string-safe.
- ``penalties``, ``logprobs``, ``structured``: what a request may ask beyond plain sampling
  (chapter 10): repetition penalties and biases, log-probabilities, grammar masks; the engine
  runs them through one interface, ``processors``, and the sampler imports none of them.
"""
