"""A watched file's version, and when a change of it is due for a reload: shared by the
policy and the API key file watchers."""

from __future__ import annotations

import time
from pathlib import Path

FileVersion = tuple[int, int, int, int, int, int, int]


def file_version(path: Path | None) -> FileVersion | None:
    """The file's version: mtime, size, inode, mode, owner and ctime (None when there is no
    file). The mtime alone misses a rewrite in the timestamp tick of its truncation (a coarse
    clock stamps both alike), after a reload read the file empty in between and was refused;
    the inode catches a file renamed over it (an atomic replace, or a Kubernetes volume's
    swap); mode and owner (the ctime, for an ACL) a permission fix alone: a file refused as
    unreadable (permission denied) is read again once the operator fixes it."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_ctime_ns)


class SettledChange:
    """When a watched file is due for a reload: its version differs from the one last read
    and is the one the previous look found, so it has kept still for a poll interval (a
    file written in parts is not read half-written; an atomic replace is as still as can
    be). ``read`` is the version last read, ``seen`` the previous look's, ``seen_at`` the
    monotonic time of the first look (or read) that found ``seen``: how long the file has
    kept still, at least (:meth:`still_s`)."""

    def __init__(self, version: FileVersion | None) -> None:
        self.read = self.seen = version
        self.seen_at = time.monotonic()

    def _see(self, version: FileVersion | None) -> None:
        if version != self.seen:
            self.seen, self.seen_at = version, time.monotonic()

    def reading(self, version: FileVersion | None) -> None:
        """``version`` is about to be read (taken before the read: a change during it
        shows as a new version at the next look)."""
        self._see(version)
        self.read = version

    def due(self, now: FileVersion | None) -> bool:
        """One look that found ``now``: whether to reload."""
        if now == self.read or now != self.seen:
            self._see(now)
            return False
        return True

    def still_s(self) -> float:
        """Seconds since a look first found the version seen last (0 just after a change):
        a slow writer's pause between two parts counts only from the look after it."""
        return time.monotonic() - self.seen_at
