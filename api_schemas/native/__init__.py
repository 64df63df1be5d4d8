"""Types of the native (superset) API, served under /native/v1."""
