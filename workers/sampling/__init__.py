"""Samplers: the interface (base.py), the torch and vLLM backends, and the sample-lane worker loop."""
