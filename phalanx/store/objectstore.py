"""The object-store tier: S3 and S3-compatible servers through ``pyarrow.fs.S3FileSystem``.

Root URL: ``s3://bucket/prefix?endpoint_override=http://host:port&region=us-east-1``.
The endpoint (and region) travel in the URL so every rank of a gang that gets the URL through
``PHALANX_STORE`` talks to the same server; credentials do not: they come from the usual AWS
environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``),
which ranks inherit from the driver, or from the AWS credential chain of each host — or from the
reference the URL names (``credentials=env:NAME`` or ``file:PATH``; ``credentials.py``), so two
sites' object stores can use different keys in one run.

Object stores cannot rename, so there is no staging area: a put writes each partition under its
final key prefix ``<prefix>/<session>/<name>/<staging_id>/part-00000.arrow`` and the metadata
seal alone makes it visible (readers find locations only in sealed metadata).  A failed put's
objects are found by listing ``<prefix>/<session>/<name>/<owner>-*`` and deleted.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from ..redact import redact
from .credentials import resolve as resolve_credentials
from .tiers import CHUNK, Staged, Tier, checksum_buffer, part_file, serialize

_OPTIONS = ("endpoint_override", "region", "scheme", "anonymous", "force_virtual_addressing", "credentials")

# pyarrow's AWS SDK sends uploads as ``aws-chunked`` bodies with checksum trailers unless told
# otherwise; S3-compatible servers that do not decode that framing (SeaweedFS, seen here) store it
# as the object's bytes, silently.  "WHEN_REQUIRED" sends plain bodies (and validates response
# checksums only where the API requires them); the store checksums every partition itself.  The
# SDK reads these from the environment when a client is configured, so they are set here, before
# this module's only S3FileSystem is made; setdefault: a user's own setting wins.
_AWS_CHECKSUM_ENV = {
    "AWS_REQUEST_CHECKSUM_CALCULATION": "WHEN_REQUIRED",
    "AWS_RESPONSE_CHECKSUM_VALIDATION": "WHEN_REQUIRED",
}


def _plain_uploads() -> None:
    for k, v in _AWS_CHECKSUM_ENV.items():
        os.environ.setdefault(k, v)


def parse_s3_url(url: str) -> tuple[str, dict[str, Any]]:
    """``s3://bucket/prefix?opts`` → (``bucket/prefix``, S3FileSystem keyword arguments)."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc:
        raise ValueError(f"not an s3://bucket/prefix URL: {redact(url)!r}")
    query = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(query) - set(_OPTIONS)
    if unknown:
        raise ValueError(
            f"store URL {redact(url)!r}: unknown option(s) {sorted(unknown)}; "
            f"known: {', '.join(_OPTIONS)} (credentials=env:NAME or file:PATH, else the AWS_* variables)"
        )
    kwargs: dict[str, Any] = {}
    endpoint = (
        query.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        e = urlparse(endpoint if "://" in endpoint else f"{query.get('scheme', 'https')}://{endpoint}")
        kwargs["endpoint_override"] = e.netloc
        kwargs["scheme"] = e.scheme
    if "scheme" in query:
        kwargs["scheme"] = query["scheme"]
    kwargs["region"] = (
        query.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    )
    for flag in ("anonymous", "force_virtual_addressing"):
        if flag in query:
            kwargs[flag] = query[flag].lower() in ("1", "true", "yes")
    if "credentials" in query:  # a reference (env:NAME, file:PATH), resolved here: credentials.py
        try:
            kwargs.update(resolve_credentials(query["credentials"]))
        except (ValueError, OSError) as exc:
            raise type(exc)(f"store URL {redact(url)!r}: {exc}") from None
    base = (u.netloc + "/" + u.path.strip("/")).rstrip("/")
    return base, kwargs


class ObjectTier(Tier):
    """``s3://bucket/prefix``: partitions are objects, downloaded whole when read."""

    kind = "s3"
    mmap = False
    atomic_rename = False

    def __init__(self, url: str):
        self.base, self.options = parse_s3_url(url)
        _plain_uploads()  # before the S3 client is configured: see _AWS_CHECKSUM_ENV
        self.fs = pafs.S3FileSystem(**self.options)
        query = urlparse(url).query
        # the URL as given (options included): what ranks get through PHALANX_STORE
        self._root_url = f"s3://{self.base}" + (f"?{query}" if query else "")
        self.url = f"s3://{self.base}"  # the prefix every location of this tier starts with

    @property
    def root_url(self) -> str:
        """The URL as given, options included: what ranks get through ``PHALANX_STORE``."""
        return self._root_url

    def __repr__(self) -> str:
        return f"ObjectTier({self.root_url})"

    def _path(self, location: str) -> str:
        if not location.startswith("s3://"):
            raise ValueError(f"not an object-store location: {location!r}")
        return location[len("s3://") :]

    def staging(self, session: str, name: str, staging_id: str) -> str:
        return self.final(session, name, staging_id)

    def final(self, session: str, name: str, version: str) -> str:
        return f"{self.url}/{session}/{name}/{version}"

    def scratch(self, session: str, tag: str) -> str:
        raise NotImplementedError("datasets are not moved into the object tier")

    def write_partition(self, location: str, index: int, table: pa.Table) -> tuple[int, str]:
        buf = serialize(table)
        self.write_buffer(location, index, buf)
        return buf.size, checksum_buffer(buf)

    def write_buffer(self, location: str, index: int, buf: pa.Buffer) -> None:
        self.write_chunks(location, index, [buf])

    def write_chunks(self, location: str, index: int, chunks: Iterable[pa.Buffer | memoryview]) -> None:
        # The output stream uploads in parts as they fill (multipart): one chunk held here at a time
        path = f"{self._path(location)}/{part_file(index)}"
        try:
            with self.fs.open_output_stream(path) as out:
                for chunk in chunks:
                    out.write(chunk)
        except BaseException:  # closing the stream completed the upload: no partial object stays
            try:
                self.fs.delete_file(path)
            except OSError:
                pass
            raise

    def read_buffer(self, location: str, index: int) -> pa.Buffer:
        # One download into memory; the IPC reader then slices it without copying.
        with self.fs.open_input_file(f"{self._path(location)}/{part_file(index)}") as f:
            return f.read_buffer()

    def read_chunks(self, location: str, index: int, size: int = CHUNK) -> Iterator[pa.Buffer]:
        with self.fs.open_input_stream(f"{self._path(location)}/{part_file(index)}") as f:
            while True:
                chunk = f.read_buffer(size)
                if not chunk.size:
                    return
                yield chunk

    def share_partition(self, src: Tier, src_location: str, index: int, location: str) -> str:
        """A server-side copy (S3 CopyObject: no byte through this host) within one object
        store; a copy through here from anywhere else, or where the server refuses it (objects
        over 5 GB need a multipart copy)."""
        if isinstance(src, ObjectTier) and src.options == self.options:
            try:
                self.fs.copy_file(
                    f"{src._path(src_location)}/{part_file(index)}", f"{self._path(location)}/{part_file(index)}"
                )
                return "server-side copy"
            except FileNotFoundError:
                raise
            except OSError:
                pass
        return super().share_partition(src, src_location, index, location)

    def commit(self, staging: str, final: str) -> None:
        if staging != final:
            raise ValueError("object tier: a put is written in place")

    def remove(self, location: str) -> None:
        try:
            self.fs.delete_dir(self._path(location))
        except FileNotFoundError:
            pass

    def remove_session(self, session: str) -> None:
        self.remove(f"{self.url}/{session}")

    def _children(self, path: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
        return [i.base_name for i in infos if i.type == pafs.FileType.Directory]

    def usage(self, location: str) -> tuple[int, float]:
        """Bytes of the objects under ``location`` and when the last was written."""
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(location), recursive=True, allow_not_found=True))
        files = [i for i in infos if i.type == pafs.FileType.File]
        return (
            sum(i.size for i in files),
            max((i.mtime.timestamp() for i in files if i.mtime is not None), default=0.0),
        )

    def staged(self, owner: str) -> list[Staged]:
        """Every ``<session>/<name>/<owner>-*`` prefix (``owner`` may be ``*``; sealed ones
        included: the store filters those out against the metadata)."""
        found = []
        for session in self._children(self.base):
            for name in self._children(f"{self.base}/{session}"):
                for version in self._children(f"{self.base}/{session}/{name}"):
                    if fnmatch.fnmatchcase(version, f"{owner}-*"):
                        found.append(Staged(session, name, version, self.final(session, name, version)))
        return found
