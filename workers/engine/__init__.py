"""Training engine: one base model, a pool of per-tenant LoRA adapters, losses and optimizers."""
