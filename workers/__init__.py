"""The compute side: jobqueue -> dispatcher -> scheduler -> engine. Never imports server/ or FastAPI."""
