"""A local server speaking the Hugging Face hub's file API, as huggingface_hub uses it: a repo's file
listing with sizes and LFS sha256s (`/api/models/{repo}[/revision/{rev}]`) and its files
(`/{repo}/resolve/{rev}/{file}`, HEAD and GET, byte ranges). It can cut a file's first transfer halfway
(`cut`) or serve it corrupted once (`corrupt`), and records every request (`log`)."""
from __future__ import annotations

import hashlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".gguf", ".safetensors")


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut: set[str] = set()  # files whose next GET stops halfway
        self.corrupt: set[str] = set()  # files whose next GET serves wrong bytes

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = files

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/api/models/{org}/{name}", self._info),
            Route("/api/models/{org}/{name}/revision/{revision:path}", self._info),
            Route("/{org}/{name}/resolve/{revision}/{file:path}", self._file, methods=["GET", "HEAD"]),
        ])

    async def _info(self, request: Request) -> Response:
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        self.log.append(("GET", request.url.path, None))
        if repo not in self.repos:
            return JSONResponse({"error": "Repository not found"}, status_code=404,
                                headers={"X-Error-Code": "RepoNotFound"})
        siblings = []
        for name, data in self.repos[repo].items():
            entry = {"rfilename": name, "size": len(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        return JSONResponse({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings, "private": False})

    async def _file(self, request: Request) -> Response:
        p = request.path_params
        repo, name = f"{p['org']}/{p['name']}", p["file"]
        self.log.append((request.method, request.url.path, request.headers.get("range")))
        data = self.repos.get(repo, {}).get(name)
        if data is None:
            return JSONResponse({"error": "Entry not found"}, status_code=404, headers={"X-Error-Code": "EntryNotFound"})
        lfs = name.endswith(LFS_SUFFIXES)
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(data).hexdigest()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        if request.method == "HEAD":
            return Response(b"", headers={**headers, "Content-Length": str(len(data))})
        if request.method == "GET" and name in self.corrupt:
            self.corrupt.discard(name)
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        if (rng := request.headers.get("range")) and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0] or 0)
        body, status = data[start:], 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(body))
        if name in self.cut:  # half the bytes, then the connection drops
            self.cut.discard(name)

            async def halfway():
                for i in range(0, len(body) // 2, 8192):
                    yield body[i:min(i + 8192, len(body) // 2)]
                raise ConnectionResetError("cut by the test")

            return StreamingResponse(halfway(), status_code=status, headers=headers)
        return Response(body, status_code=status, headers=headers)
