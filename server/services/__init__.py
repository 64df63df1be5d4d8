"""Business rules of the gateway (no FastAPI imports): sessions, models, training, futures, checkpoints."""
