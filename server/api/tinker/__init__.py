"""Routes of the Tinker API (/api/v1), one module per resource; handler name = endpoint name."""
