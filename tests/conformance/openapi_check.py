"""Checks an HTTP answer against the server's own OpenAPI document: its status must be declared for the route
it came from, and a JSON body must match the schema declared for that status."""

from __future__ import annotations

import re
from typing import Any

import httpx
import jsonschema


PATH_PARAMS = {"relpath", "checkpoint_id", "model"}  # FastAPI `{name:path}` parameters: they may hold "/"


def _param(m: re.Match[str]) -> str:
    return ".+" if m.group(1) in PATH_PARAMS else "[^/]+"


class Contract:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self._routes = [(re.compile("^" + re.sub(r"\{(\w+)\}", _param, p) + "$"), p) for p in doc["paths"]]

    def template(self, method: str, path: str) -> str:
        """The document's path template for a concrete path (the first that matches, as FastAPI routes)."""
        for regex, template in self._routes:
            if method.lower() in self.doc["paths"][template] and regex.match(path):
                return template
        raise AssertionError(f"{method} {path} is not in the OpenAPI document")

    def check(self, r: httpx.Response) -> int:
        """Assert that `r` is declared for its request's route; returns its status."""
        method, path = r.request.method, r.request.url.path
        op = self.doc["paths"][self.template(method, path)][method.lower()]
        declared = op["responses"].get(str(r.status_code))
        assert declared is not None, (f"{method} {path} answered {r.status_code}, which the document does not "
                                      f"declare (declared: {sorted(op['responses'])}): {r.text[:300]}")
        media = r.headers.get("content-type", "").split(";")[0].strip()
        content = declared.get("content", {})
        if content:
            assert media in content, f"{method} {path} {r.status_code}: {media!r} is not one of {sorted(content)}"
            schema = content[media].get("schema")
            if schema and media == "application/json":
                jsonschema.validate(r.json(), {**schema, "components": self.doc["components"]})
        return r.status_code
