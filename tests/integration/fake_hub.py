"""A local stand-in for the Hugging Face Hub, speaking the part of its HTTP API that `HfApi.create_repo` and
`HfApi.create_commit` use: repo creation, preupload (regular vs LFS), the LFS batch API with basic PUT transfer,
and the NDJSON commit. It keeps what arrives (repos, visibility, files, the tokens used) for tests to check.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Repo:
    visibility: str
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)


class FakeHub:
    def __init__(self, tokens: set[str]) -> None:
        self.tokens = tokens
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.seen_auth: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


_PRE = re.compile(r"^/api/models/([^/]+/[^/]+)/preupload/([^/]+)$")
_COMMIT = re.compile(r"^/api/models/([^/]+/[^/]+)/commit/([^/]+)$")
_BATCH = re.compile(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$")
_PUT = re.compile(r"^/lfs-upload/([0-9a-f]{64})$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _body(self) -> bytes:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            return gzip.decompress(raw) if self.headers.get("Content-Encoding") == "gzip" else raw

        def _send(self, status: int, payload: Any, ctype: str = "application/json") -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            auth = self.headers.get("Authorization", "")
            with hub.lock:
                hub.seen_auth.append(auth)
            if auth.removeprefix("Bearer ") not in hub.tokens:
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return False
            return True

        def do_POST(self) -> None:  # noqa: N802
            body = self._body()
            if not self._authorized():
                return
            path = self.path.split("?")[0]
            if path == "/api/repos/create":
                req = json.loads(body)
                repo_id = f"{req['organization']}/{req['name']}"
                with hub.lock:
                    if repo_id in hub.repos:
                        return self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                    vis = req.get("visibility") or ("private" if req.get("private") else "public")
                    hub.repos[repo_id] = Repo(visibility=vis)
                return self._send(200, {"url": f"{hub.url}/{repo_id}"})
            if m := _PRE.match(path):
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                          "shouldIgnore": False} for f in files]
                return self._send(200, {"files": modes, "commitOid": "0" * 40})
            if m := _BATCH.match(path):
                req = json.loads(body)
                objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                            "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}} for o in req["objects"]]
                return self._send(200, {"transfer": "basic", "objects": objects}, "application/vnd.git-lfs+json")
            if m := _COMMIT.match(path):
                return self._commit(m.group(1), body)
            self._send(404, {"error": f"no route {path}"})

        def _commit(self, repo_id: str, body: bytes) -> None:
            with hub.lock:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._send(404, {"error": "Repository not found"})
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "file":
                        repo.files[value["path"]] = base64.b64decode(value["content"])
                    elif item["key"] == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            return self._send(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                        repo.files[value["path"]] = hub.lfs[value["oid"]]
                oid = uuid.uuid4().hex + "00000000"
                repo.commits.append(oid)
            self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": None})

        def do_PUT(self) -> None:  # noqa: N802
            m = _PUT.match(self.path.split("?")[0])
            data = self._body()
            if m is None or hashlib.sha256(data).hexdigest() != m.group(1):
                return self._send(400, {"error": "bad LFS upload"})
            with hub.lock:
                hub.lfs[m.group(1)] = data
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler
