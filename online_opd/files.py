"""Durable files: sha256 of a file, fsync, and atomic writes of files and folders.

One discipline for every file this project publishes (trace segments, drafter
checkpoints, the registry's pointers, the embedded target's folder):

1. write into a hidden temporary sibling ``.<name>.<random>.tmp`` in the same
   folder (same file system, so the rename below is atomic);
2. flush and fsync its bytes (a folder: every file in it, then the folder);
3. ``os.replace`` it onto the final name;
4. fsync the parent folder, so the rename itself survives a crash.

A reader sees the old content or the new, whole, never a torn file. An
exception before step 3 removes the temporary and leaves the old content
untouched. Temporary names start with ``.`` and end with ``.tmp``
(``is_temp_name``), so a folder scan can skip them and clean up those a
crashed writer left behind. POSIX local file systems only: directory fsync
and ``os.replace`` of folders are not portable to object stores.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TEMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_CHUNK_BYTES = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (a folder: makes a rename into it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path, suffix: str = TEMP_SUFFIX) -> Path:
    """A fresh hidden name beside ``path``: ``.<name>.<12 hex>.tmp``."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{suffix}"


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of ``temp_sibling``'s (or any hidden ``.tmp``)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def write_temp_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to a new ``temp_sibling(path)``, flushed and fsynced; returns the temp path.

    Steps 1-2 of the module's discipline; ``replace_durably`` is steps 3-4.
    Split so a caller can choose the final name after the bytes are durable.
    """
    tmp = temp_sibling(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def replace_durably(tmp: Path, path: Path) -> Path:
    """``os.replace(tmp, path)`` then fsync the folder; ``tmp`` is removed if the rename fails."""
    try:
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_path(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically and durably (module docstring)."""
    path = Path(path)
    return replace_durably(write_temp_bytes(path, data), path)


def atomic_write_file(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Replace ``path`` atomically and durably with what ``write(tmp)`` writes to a temporary sibling:
    for writers that stream to a file (no whole-file bytes in memory)."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        write(tmp)
        fsync_path(tmp)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return replace_durably(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write_bytes`` of ``text`` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, sort_keys: bool = False) -> Path:
    """``obj`` as JSON indented by 2 (keys sorted if asked) with a final newline, written atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary sibling folder to fill; on a clean exit publish it as ``path``.

    Publishing fsyncs every file in it and the folder, swaps it with an
    existing ``path`` in one step where the system can (``exchange_paths``;
    elsewhere it moves the old one aside, then replaces), fsyncs the parent,
    then deletes the old copy.
    An exception inside the block deletes the temporary folder and leaves
    ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        _publish_folder(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish_folder(tmp: Path, path: Path) -> None:
    for item in sorted(tmp.rglob("*"), reverse=True):  # files before the folders holding them
        fsync_path(item)
    fsync_path(tmp)
    if path.exists() and exchange_paths(tmp, path):
        fsync_path(path.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
        return
    old = None
    if path.exists():  # no atomic exchange here: a moment with no folder at ``path``
        old = temp_sibling(path, OLD_SUFFIX)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        raise
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False, changing nothing, where the platform or the file system
    cannot (other systems, old kernels, some network file systems).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
