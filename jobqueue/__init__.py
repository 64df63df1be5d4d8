"""Carries jobs from the gateway to the workers and results back. Imports api_schemas only."""
