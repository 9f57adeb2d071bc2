"""What every exporter shares, the methods' ``export.py`` included: ``common`` (file names, the error type,
tensor and target views, the bundle), ``identity`` (the target stamp an export carries) and ``snippets`` (the
serving snippets of an export's README).

A layer of its own between models/core/ and the methods (tests/test_layers.py): it imports only core, so a method
can build on it; the rest of models/export/ sits above the methods and the registry.
"""
