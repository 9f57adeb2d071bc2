"""The core every method and every caller builds on: the frozen target (``target``, ``gguf``, ``target_view``,
``tokenizer``, ``kernels``), drafting and verification (``proposal``, ``verify``, ``tree``, ``acceptance``,
``ragged``, ``generate``), shared draft building blocks (``rope``, ``norm``, ``vocab``, ``losses``,
``drafter``), checkpoints (``checkpoint``) and the method contract (``spec``, ``config_checks``).

It imports nothing else of draftsmith: methods (models/methods/), the registry, data/, export, train/ and eval/
all sit above it (tests/test_layers.py).
"""
