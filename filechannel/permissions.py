"""The permission policy of a channel's files: who may read them, and which directories are safe to open.

This module owns the policy; ``_fs`` only applies the modes it is given.

* ``permissions="owner"`` (the default): every file filechannel creates is
  0600 and every directory 0700, whatever the umask. Nobody else can read an
  event, nor open the ``LOCK`` file to ``flock`` it and lock the owner out.
* ``permissions="group"``: files 0640, directories 0750, for a reader that
  runs as another user of the directory's group (``stat``, ``dump``,
  ``verify``, a ``ChannelReader`` view). The group can read, never write: a
  consumer that acknowledges writes ``DIR/consumers``, so it runs as the
  owner. ``LOCK`` files stay 0600 under either policy.

:func:`check_channel_dir` is the check at open, as PostgreSQL checks its data
directory: an owning open (a channel, a write-ahead log) refuses a directory
that is not owned by the effective user (root's included, unless running as
root) or that has group or other bits beyond what the policy allows (0700, or
0750 with ``"group"``): whoever can write it can swap the files, whoever can
read it reads the events. An existing *empty* directory that a new channel is
created in is tightened to the policy's mode instead, as ``initdb`` does; a
non-empty one without a ``CHANNEL`` file is not a channel (yet): its mode is
left to the caller, which refuses foreign entries (``NotAChannelError``) and
creates every file of its own private whatever the directory's mode.

A process that writes into a channel it did not open with a policy (a
``ChannelReader`` registering its consumer) takes the policy from the channel
directory's mode (:func:`policy_of`), as PostgreSQL does for its data
directory: group-readable means ``"group"``.

A read-only inspection (``readonly=True``: ``stat``, ``dump``, ``verify``,
``ChannelReader``) is never refused: it writes nothing the channel relies
on, often runs as another user by design, and is what one runs to look at a
directory whose permissions are wrong. It logs a warning when the directory
is writable by anyone but its owner, since its contents may have been
replaced.
"""

from __future__ import annotations

import logging
import os
import pwd

from ._fs import FS, with_modes
from .errors import ConfigError, UnsafePermissionsError

__all__ = ["MODES", "PERMISSIONS", "check_channel_dir", "fs_for", "modes", "policy_of"]

logger = logging.getLogger(__name__)

# log.CHANNEL_FILE (log imports this module): its presence makes a directory a channel.
_CHANNEL_FILE = "CHANNEL"

PERMISSIONS = ("owner", "group")
#: ``permissions`` -> (file mode, directory mode).
MODES = {"owner": (0o600, 0o700), "group": (0o640, 0o750)}


def modes(permissions: str) -> tuple[int, int]:
    """Return ``(file mode, directory mode)`` of a ``permissions`` policy.

    Raises:
        ConfigError: ``permissions`` is not one of :data:`PERMISSIONS`.
    """
    try:
        return MODES[permissions]
    except (KeyError, TypeError):
        raise ConfigError("permissions", f"must be one of {PERMISSIONS}, got {permissions!r}") from None


def fs_for(fs: FS, permissions: str) -> FS:
    """Return ``fs`` set to create files and directories with the modes of ``permissions``.

    ``fs`` itself under the default policy (no copy, no change); see
    :func:`filechannel._fs.with_modes` for the others.
    """
    return with_modes(fs, *modes(permissions))


def policy_of(fs: FS, directory: str) -> str:
    """Return the policy a channel directory's mode shows: ``"group"`` if its group can read it, else ``"owner"``."""
    try:
        _, mode = fs.stat_owner(directory)
    except FileNotFoundError:
        return "owner"
    return "group" if mode & 0o040 else "owner"


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _who(bits: int) -> str:
    """Name who ``bits`` (of 0o077) give access to, and what they can do."""
    parts = []
    for who, shift in (("its group", 3), ("other users", 0)):
        b = (bits >> shift) & 0o7
        if b:
            can = [v for v, m in (("read", 4), ("write", 2), ("enter", 1)) if b & m]
            parts.append(f"{who} can {'/'.join(can)}")
    return " and ".join(parts)


def check_channel_dir(fs: FS, path: str, permissions: str = "owner", *, readonly: bool = False) -> None:
    """Check that the directory ``path`` is safe to open under ``permissions``.

    Nothing to check when ``path`` does not exist (or is not a directory): it
    is created with the right mode, or the caller refuses it. An existing empty
    directory owned by the effective user is tightened to the policy's mode
    (where a new channel is about to be created); the mode of a non-empty one
    without a ``CHANNEL`` file is not checked (it is no channel: the caller says so).

    Args:
        fs: The file system.
        path: A channel (or write-ahead log, or data) directory.
        permissions: ``"owner"`` (0700 at most) or ``"group"`` (0750 at most).
        readonly: An inspection that writes nothing the channel relies on:
            only a warning, never a refusal (see the module docstring).

    Raises:
        UnsafePermissionsError: An owning open of a directory owned by another
            user, or with group or other bits beyond what ``permissions`` allows;
            the message names the path, what was found and the fix.
        ConfigError: ``permissions`` is unknown.
    """
    _, dir_mode = modes(permissions)
    if not fs.isdir(path):
        return
    uid, mode = fs.stat_owner(path)
    if readonly:
        if mode & 0o022:
            logger.warning(
                "%s is writable by %s (mode %04o): its files may not be the channel's", path, _who(mode & 0o022), mode
            )
        return
    euid = os.geteuid()
    if uid != euid:
        raise UnsafePermissionsError(
            path,
            uid,
            mode,
            dir_mode,
            f"it is owned by {_user(uid)}, not by {_user(euid)} that opens it",
            f"open it as its owner, or give it to this user: `chown -R {_user_name(euid)} {path}`",
        )
    extra = mode & 0o077 & ~dir_mode
    if not extra:
        return
    if not fs.exists(os.path.join(path, _CHANNEL_FILE)):
        if not fs.listdir(path):
            fs.chmod(path, dir_mode)  # a new channel's own directory, made before it
            logger.info("set the mode of the empty directory %s to %04o (permissions=%r)", path, dir_mode, permissions)
        return
    fix = f"run `chmod {dir_mode:o} {path}`"
    if permissions == "owner" and not mode & 0o027:
        fix += ", or open it with permissions='group' to let its group read it"
    raise UnsafePermissionsError(
        path,
        uid,
        mode,
        dir_mode,
        f"its mode is {mode:04o}: {_who(extra)} (permissions={permissions!r} allows at most {dir_mode:04o})",
        fix,
    )


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
