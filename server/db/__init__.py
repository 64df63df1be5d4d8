"""SQL storage: SQLAlchemy 2.0 rows and the repositories that are the only place SQL is written."""
