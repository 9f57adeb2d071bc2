"""One training run per output directory: an exclusive lock file holding the owner's pid, host and start time.

The file is created with O_EXCL (exactly one of two racing runs gets it). A lock left by a dead process on this
host (kill -9) is detected and taken over with a warning; one from another host is never guessed about.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from models.core.checkpoint import NoSpaceError
from train.checks import ConfigError

LOCK = "train.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _stale(lock: Path, held: dict, host: str) -> bool:
    if not held:  # empty/unreadable: its writer died between create and write (it takes microseconds)
        try:
            return time.time() - lock.stat().st_mtime > 10
        except FileNotFoundError:
            return True
    return held.get("host") == host and isinstance(held.get("pid"), int) and not _alive(held["pid"])


def _not_writable(out_dir: Path, e: OSError) -> ConfigError:
    return ConfigError(f"output_dir {out_dir} is not writable ({e.strerror or e}); choose another output_dir")


def acquire(out_dir: Path) -> Path:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (PermissionError, OSError) as e:
        if isinstance(e, FileExistsError):  # a file where the directory should be
            raise ConfigError(f"output_dir {out_dir} exists and is not a directory; choose another output_dir") \
                from None
        raise _not_writable(out_dir, e) from None
    lock = out_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = _read(lock)
            if _stale(lock, held, me["host"]):
                print(f"warning: taking over stale lock {lock} (pid {held.get('pid')} is gone)", file=sys.stderr)
                lock.unlink(missing_ok=True)
                continue
            raise ConfigError(
                f"output_dir {out_dir} is in use by another run (pid {held.get('pid')} on {held.get('host')}, "
                f"started {held.get('started')}); wait for it, use another output_dir, or delete {lock} "
                "if that run is gone") from None
        except OSError as e:  # EROFS (a read-only mount), EACCES, ENOSPC: before anything was loaded
            if e.errno == errno.ENOSPC:
                raise NoSpaceError(lock, "free space") from None
            raise _not_writable(out_dir, e) from None
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(me))
            fh.flush()
            os.fsync(fh.fileno())
        return lock
    raise ConfigError(f"could not take the lock {lock}; delete it if no run uses {out_dir}")


@contextmanager
def hold_output_dir(out_dir: Path):
    """Rank 0 holds the lock for the whole run (the other ranks of a job share rank 0's directory)."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    lock = acquire(out_dir)
    try:
        yield
    finally:
        if _read(lock).get("pid") == os.getpid():
            lock.unlink(missing_ok=True)
