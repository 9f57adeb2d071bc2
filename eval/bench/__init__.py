"""The benchmark harness behind ``python -m eval``: methods and prompts (``setup``), the run (``benchmark``), the
cost model (``cost_model``), the lossless judge (``precision``), pooled statistics (``stats``), the batch sweep
(``batch_sweep``), HF peers (``peers``), training cost and learning curves (``training``), the report
(``report``; ``python -m eval.bench.report``), conf/eval.yaml's method rows (``defaults``) and the dtype probe
(``python -m eval.bench.probe``).

Above eval/decode/, below eval/engines/ (tests/test_layers.py).
"""
