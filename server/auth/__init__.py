"""API keys: generation (tml- prefix), hashing, and key -> tenant resolution."""
