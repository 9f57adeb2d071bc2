"""The decoding loop: one ladder with a batch dimension, lossless by construction.

``ladder`` (the batched ladder: prefill, verify, accept, commit), ``window`` (its KV/position bookkeeping),
``single`` (the B=1 API: ``decode_ar``, ``speculative_decode``), ``batch`` (the B-row API:
``decode_ar_batch``, ``speculative_decode_batch``), ``result`` (``DecodeResult`` and the input checks).

The lowest of eval's layers: below it only models/; above it eval/bench/ and eval/engines/
(tests/test_layers.py).
"""
