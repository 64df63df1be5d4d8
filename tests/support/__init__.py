"""Helpers shared by the test suites: tiny offline models and the like."""
