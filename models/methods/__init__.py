"""The draft methods: one package per method (``models/methods/<name>/``), each exporting ``SPEC``.

Everything under ``models/methods/`` is a method; the rest of ``models/`` is core (the frozen target, decoding
and verification, shared draft building blocks, checkpoints, export plumbing). models/registry.py is the only
list of methods.
"""
