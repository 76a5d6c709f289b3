"""Structured outputs: grammar-constrained decoding (xgrammar), tool-call and reasoning parsing.

`SamplingParams.structured_outputs` names one constraint (see `spec.KINDS`); the engine compiles
it once per source, gives each sequence its own matcher (on the request), and the sampler masks
the logits of constrained rows with the matcher's token bitmask.
"""
