"""A real S3-compatible HTTP server on loopback (moto's server mode) for the remote tests."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def moto_s3(wrap=None) -> Iterator[str]:
    """Start the server, point the ``AWS_*`` environment at it; yield the endpoint URL.
    ``wrap``: applied to the server's WSGI application (a middleware, e.g. ``PutCounter``)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    class S3Only(server_mod.DomainDispatcherApplication):
        """moto's dispatcher for S3 alone: moto's own found each request's service by
        listing its ~150 service packages on disk, twice per request (two thirds of a
        request's time on a loaded machine)."""

        def get_application(self, environ):
            with self.lock:
                if "s3" not in self.app_instances:
                    self.app_instances["s3"] = self.create_app("s3")
                return self.app_instances["s3"]

    class Server(server_mod.ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = S3Only(server_mod.create_backend_app)
            self._server = make_server(self._ip_address, self._port, app if wrap is None else wrap(app), True)
            self._server_ready_event.set()
            self._server.serve_forever()

    server = Server(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        with aws_env(f"http://{host}:{port}") as endpoint:
            yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def aws_env(endpoint: str) -> Iterator[str]:
    """The ``AWS_*`` environment pointed at ``endpoint`` (test credentials), restored after."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": endpoint,
           "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server; its name."""
    import boto3

    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


class PutCounter:
    """WSGI middleware counting the requests that send bodies to the server: ``puts`` and
    ``put_bytes`` (PUT: objects and multipart parts), ``posts`` and ``post_bytes``; and
    recording the path of every GET (``gets``)."""

    def __init__(self, app):
        self.app = app
        self.puts = self.put_bytes = self.posts = self.post_bytes = 0
        self.gets: list[str] = []

    def __call__(self, environ, start_response):
        method = environ.get("REQUEST_METHOD")
        if method == "GET":
            self.gets.append(environ.get("PATH_INFO", ""))
        if method in ("PUT", "POST"):
            n = int(environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get("CONTENT_LENGTH") or 0)
            if method == "PUT":
                self.puts, self.put_bytes = self.puts + 1, self.put_bytes + n
            else:
                self.posts, self.post_bytes = self.posts + 1, self.post_bytes + n
        return self.app(environ, start_response)


class RequestCounter:
    """WSGI middleware counting every request by method and by what it asks for:
    ``count("GET", "manifest")`` (a snapshot's ``manifest.json``: the existence check),
    ``count("GET", "part")`` (a part of an object table: ``remote/_parts.py``),
    ``count("GET", "object")`` (anything else), ``count("HEAD")``; ``reset()`` starts over."""

    def __init__(self, app):
        import threading

        self.app = app
        self._lock = threading.Lock()
        self.seen: list[tuple[str, str]] = []

    def reset(self) -> None:
        with self._lock:
            self.seen = []

    def count(self, method: str, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for m, k in self.seen if m == method and kind in (None, k))

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        kind = "manifest" if path.endswith("/manifest.json") else "part" if "/parts/" in path else "object"
        with self._lock:
            self.seen.append((environ.get("REQUEST_METHOD", ""), kind))
        return self.app(environ, start_response)


@contextlib.contextmanager
def counting_moto_s3(counter_cls=None) -> Iterator[tuple[str, Any]]:
    """:func:`moto_s3` whose server counts what it is sent: ``counter_cls`` (default
    :class:`PutCounter`, the bytes; :class:`RequestCounter`, every request) wraps it."""
    counter: list[Any] = []

    def wrap(app):
        counter.append((counter_cls or PutCounter)(app))
        return counter[0]

    with moto_s3(wrap=wrap) as endpoint:
        yield endpoint, counter[0]



@pytest.fixture(scope="module")
def s3():
    """A loopback S3 server for a test module (``from s3server import s3``)."""
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Dense arrays published as 1 KiB chunks, so that small stores span many objects:
    every test of a module that imports it (``from s3server import small_chunks``)."""
    import dataclasses

    from mmbuffer._disk import format as fmt

    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=1024))


def table_objects(fs, root: str, snapshot: str) -> dict[str, list[Any]]:
    """Every object a published snapshot's table names (``rel -> [size, digest(, holder)]``),
    from its root ``objects.json`` and, from table version 4, its parts (``remote/_parts.py``)."""
    import json

    body = json.loads(fs.cat_file(f"{root}/snapshots/{snapshot}/objects.json"))
    objects = dict(body["objects"])
    for key, (_, _, holder) in body.get("parts", {}).items():
        objects.update(json.loads(fs.cat_file(f"{root}/snapshots/{holder}/parts/{key}.json"))["objects"])
    return objects


def flat_table(fs, root: str, snapshot: str, version: int = 3) -> dict[str, Any]:
    """A snapshot's table as one ``objects.json`` body of ``version`` (< 4: no parts), what
    mmbuffer wrote before table version 4."""
    import json

    body = json.loads(fs.cat_file(f"{root}/snapshots/{snapshot}/objects.json"))
    objects = {rel: v if len(v) < 3 or v[2] != snapshot else v[:2] for rel, v in table_objects(fs, root, snapshot).items()}
    return {k: v for k, v in body.items() if k != "parts"} | {"version": version, "objects": objects}
