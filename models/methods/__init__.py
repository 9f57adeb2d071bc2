"""The draft methods: one package per method (``models/methods/<name>/``), each exporting ``SPEC``.

Everything under ``models/methods/`` is a method; a method builds on ``models/core/`` (the frozen target, decoding
and verification, shared draft building blocks, checkpoints) and the export helpers. models/registry.py is the only
list of methods.
"""
