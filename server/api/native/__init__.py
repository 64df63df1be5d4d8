"""Routes of the native (superset) API, under /native/v1."""
