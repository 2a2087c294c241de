"""Where the trace buffer's segments live: a local folder, or a prefix of an S3-compatible bucket.

``open_store(location)`` returns a ``LocalStore`` for a folder path and an ``ObjectStore`` for
``s3://bucket/prefix``. online_opd/traces/buffer.py names, encodes, verifies, tails and bounds
segments through either one, so names, cursors and records are the same code on both; this module
only moves bytes. Operations take segment names, never paths: list, read, publish (write once),
delete, and quarantine (move under ``quarantine/`` beside the segments).

Local folder (the default): publish writes a hidden ``.tmp`` sibling, fsyncs it, ``os.replace``s it
onto the final name and fsyncs the folder (online_opd/files.py); a reader sees a whole file or none.

Object store, through ``pyarrow.fs`` (``FileSystem.from_uri``):

- A segment is one immutable object written with one request: pyarrow's delayed open buffers the
  bytes and sends a single PUT when the stream closes (a segment larger than pyarrow's upload part
  goes as a multipart upload, which also appears only when it completes). An S3 PUT is atomic:
  readers see the whole object or nothing, so there is no temporary name and no rename. The final
  name is chosen before the upload, so the object appears up to one upload time later than the
  time in its name; ``tail``'s ``settle_s`` covers that, as it covers a slow local writer.
- The sha256 in the name is still verified on every read: nothing else catches a damaged object or
  a foreign write under a segment name.
- Quarantine is a copy then a delete (S3 has no rename); a reader stopped between the two leaves a
  copy in ``quarantine/`` and the original, which the next reader moves again.
- Retention deletes objects (pyarrow makes each delete a HEAD, the DELETE, and a PUT of an empty
  ``prefix/`` marker so the "directory" goes on existing; no listing shows the marker as a segment).
  No temporary objects exist, so there are none to clean up.
- Endpoint, credentials and region come from the standard AWS settings, read by pyarrow itself:
  ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (``http://`` for a local server), ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``~/.aws``. Query parameters of
  the URI that pyarrow accepts (``region=``, ``endpoint_override=``, ``scheme=``) override them.
- Every listing is one LIST request per 1000 objects (each ``tail``, and retention after each write).

The drafter registry does not live here: it needs compare-and-swap on its ``CURRENT`` pointer, which
pyarrow's file systems cannot give (docs/architecture.md "Buffer segments").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from online_opd.files import replace_durably, write_temp_bytes

URI_SCHEMES = ("s3",)
QUARANTINE_DIR = "quarantine"


@dataclass(frozen=True)
class StoredFile:
    """One file (object) directly under the store's root, or under its quarantine."""

    name: str
    size: int
    mtime: float  # seconds since the epoch
    location: Path | str  # a local path, or the object's URI


def is_uri(location: str | os.PathLike) -> bool:
    """Whether ``location`` is a URI (``scheme://...``) rather than a folder path."""
    return isinstance(location, str) and "://" in location


def check_location(location: str | os.PathLike) -> Path | str:
    """A folder as a ``Path``, or a supported URI as a string without a trailing ``/``.

    ValueError, naming the value and what is accepted, for any other scheme or a URI without a
    bucket. Touches neither the disk nor the network.
    """
    if not is_uri(location):
        return Path(location)
    parts = urlsplit(str(location))
    accepted = ("a trace buffer is a local folder path, or s3://bucket/prefix on an S3-compatible store "
                "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    if parts.scheme not in URI_SCHEMES:
        raise ValueError(f"unsupported scheme {parts.scheme!r} in {location!r}: {accepted}")
    if not parts.netloc:
        raise ValueError(f"{location!r} names no bucket: {accepted}")
    return urlunsplit(parts._replace(path=parts.path.rstrip("/")))


def canonical_location(location: str | os.PathLike) -> str:
    """What replicas compare and what the engine is handed: an absolute folder path, or the URI."""
    checked = check_location(location)
    return checked if isinstance(checked, str) else str(checked.resolve())


def open_store(location: str | os.PathLike) -> Store:
    """The store for a folder path or an ``s3://`` URI (``check_location``'s errors for others)."""
    checked = check_location(location)
    return ObjectStore(checked) if isinstance(checked, str) else LocalStore(checked)


class LocalStore:
    """Segments as files of one folder (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def exists(self) -> bool:
        return self.root.is_dir()

    def prepare(self) -> None:
        """Create the folder (and its parents) for a writer."""
        self.root.mkdir(parents=True, exist_ok=True)

    def list(self, quarantined: bool = False) -> list[StoredFile]:
        """Files directly in the folder (or in its quarantine), unsorted; FileNotFoundError without the folder."""
        folder = self.root / QUARANTINE_DIR if quarantined else self.root
        files = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        if not entry.is_file():
                            continue
                        st = entry.stat()
                    except FileNotFoundError:  # deleted by another writer's retention meanwhile
                        continue
                    files.append(StoredFile(entry.name, st.st_size, st.st_mtime, Path(entry.path)))
        except FileNotFoundError:
            if quarantined:
                return []
            raise
        return files

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def publish(self, data: bytes, final_name_for: Callable[[], str]) -> Path:
        """Write ``data`` to a durable temporary file, then rename it to ``final_name_for()``.

        The final name is chosen after the bytes are durable, so its timestamp is as close as
        possible to the moment the segment becomes visible.
        """
        self.root.mkdir(parents=True, exist_ok=True)  # recreate a folder someone removed
        tmp = write_temp_bytes(self.root / "seg", data)
        try:
            final = self.root / final_name_for()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return replace_durably(tmp, final)

    def delete(self, name: str) -> None:
        """Remove one file; FileNotFoundError when it is already gone."""
        os.remove(self.root / name)

    def quarantine(self, name: str) -> Path:
        """Move a segment into ``quarantine/``; FileNotFoundError when it is already gone."""
        folder = self.root / QUARANTINE_DIR
        folder.mkdir(exist_ok=True)
        os.replace(self.root / name, folder / name)
        return folder / name


class ObjectStore:
    """Segments as objects under one prefix of a bucket, through ``pyarrow.fs`` (module docstring)."""

    def __init__(self, uri: str) -> None:
        import pyarrow.fs as pafs

        self._pafs = pafs
        parts = urlsplit(uri)
        self.root = urlunsplit(parts._replace(query=""))  # shown in logs and stats: no query parameters
        query = dict(parse_qsl(parts.query))
        query.setdefault("allow_delayed_open", "true")  # one PUT when the stream closes
        self.fs, self.base = pafs.FileSystem.from_uri(urlunsplit(parts._replace(query=urlencode(query))))
        self.bucket = self.base.split("/", 1)[0]

    def _key(self, *names: str) -> str:
        return "/".join([self.base, *names])

    def exists(self) -> bool:
        """Whether the bucket exists (a prefix exists as soon as one object is under it)."""
        return self.fs.get_file_info(self.bucket).type == self._pafs.FileType.Directory

    def prepare(self) -> None:
        """Check that the bucket exists: buckets are made by their owner, never by a writer."""
        if not self.exists():
            raise FileNotFoundError(f"bucket {self.bucket!r} of the trace buffer {self.root} does not exist "
                                    f"(or these credentials cannot see it) at the endpoint in "
                                    f"AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL ({self._endpoint()}): create it first")

    def _endpoint(self) -> str:
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"

    def list(self, quarantined: bool = False) -> list[StoredFile]:
        """Objects directly under the prefix (or its quarantine), unsorted; none for a missing prefix."""
        key = self._key(QUARANTINE_DIR) if quarantined else self.base
        selector = self._pafs.FileSelector(key, recursive=False, allow_not_found=True)
        files = []
        for info in self.fs.get_file_info(selector):
            if info.type != self._pafs.FileType.File:
                continue
            mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
            files.append(StoredFile(info.base_name, info.size, mtime, self._uri(info.path)))
        return files

    def _uri(self, key: str) -> str:
        return f"{urlsplit(self.root).scheme}://{key}"

    def read(self, name: str) -> bytes:
        with self.fs.open_input_stream(self._key(name)) as f:  # one GET
            return f.read()

    def publish(self, data: bytes, final_name_for: Callable[[], str]) -> str:
        """Write ``data`` as one new object named ``final_name_for()``: visible whole, or not at all."""
        key = self._key(final_name_for())
        with self.fs.open_output_stream(key, compression=None) as out:
            out.write(data)
        return self._uri(key)

    def delete(self, name: str) -> None:
        """Delete one object; FileNotFoundError when it is already gone."""
        self.fs.delete_file(self._key(name))

    def quarantine(self, name: str) -> str:
        """Copy a segment under ``quarantine/`` and delete it; FileNotFoundError when it is already gone."""
        dest = self._key(QUARANTINE_DIR, name)
        self.fs.move(self._key(name), dest)
        return self._uri(dest)


Store = LocalStore | ObjectStore
