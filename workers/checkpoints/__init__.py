"""Checkpoint storage and hub push."""
