"""Built-in training programs, one per seed system; each runs under ``torchrun -m``.

Recipe metadata (name, module, description, arguments) lives in ``catalog.json``,
so the service can list recipes without importing torch code, and each recipe
builds its argument parser from the same entry.
"""
