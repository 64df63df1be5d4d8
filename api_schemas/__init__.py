"""Wire contracts: Tinker/native HTTP types and the gateway<->worker job contract. No torch, no FastAPI."""
