"""HTTP routes: thin modules that parse, call one service, and return a schema."""
