"""A watched file's version, shared by the policy and the API key file watchers."""

from __future__ import annotations

from pathlib import Path

FileVersion = tuple[int, int, int]


def file_version(path: Path | None) -> FileVersion | None:
    """The file's version: mtime, size and inode (None when there is no file). The mtime
    alone misses a rewrite in the timestamp tick of its truncation (a coarse clock stamps
    both alike), after a reload read the file empty in between and was refused; the inode
    catches a file renamed over it (an atomic replace, or a Kubernetes volume's swap)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)
