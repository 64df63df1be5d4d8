"""Composition root: the only code that imports both server/ and workers/."""
