"""The native protocol's services (twinkle-kit's own client): adapters, training steps, saves, sampling, runs."""
