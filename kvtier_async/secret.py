"""A tier's secret: where it comes from, and the checks it passes before any tier uses it.

A persistent tier (fs, redis, s3) shared between tenants takes `"secret_env": NAME` (an
environment variable holding it) or `"secret_file": PATH` (a file that belongs to the user and
that nobody else may read or write, as ssh insists for keys). Never inline: a tier config ends
up in an engine's argv, its start-up log and its config dumps. `kvtier secret new` prints a
fresh one. What the secret does is `block_format.BlockSealer`'s business.

The secret itself never appears in an exception, a log line, `repr` or `stats()`: errors name
the variable or the file, never the value.
"""

from __future__ import annotations

import os
import secrets
import stat

from .errors import ConfigError

__all__ = ["MIN_DISTINCT_BYTES", "MIN_SECRET_BYTES", "load_private_value", "load_tier_secret", "new_secret"]

#: A secret shorter than this is refused: 32 bytes of a fresh one are 256 bits.
MIN_SECRET_BYTES = 32
#: A secret with fewer distinct bytes than this, or than just over half its length (hex decoded
#: first), is refused as obviously weak ("a" * 32, a few bytes cycled): 32 random bytes hold
#: about 30, and fewer than 16 with a chance of 3e-17; 16 random bytes (32 hex digits, 128
#: bits, `secrets.token_hex(16)` or a uuid4) hold fewer than 9 with a chance of 1e-10. Nothing
#: here catches a guessable secret of distinct bytes (bytes(range(32)), a phrase): only a
#: random one is safe.
MIN_DISTINCT_BYTES = 16
#: A secret or password file longer than this is not one (read no further).
MAX_SECRET_FILE_BYTES = 4096


def new_secret() -> str:
    """A fresh secret: 32 random bytes as 64 hex digits (256 bits)."""
    return secrets.token_hex(32)


def load_tier_secret(
    tier: str, *, secret_env: object = None, secret_file: object = None, secret: object = None
) -> bytes | None:
    """The secret a tier config names, or None when it names none; a `ConfigError` for an inline
    secret, both sources at once, a missing or unsafe source, or a secret under 32 bytes."""
    if secret is not None:
        raise ConfigError(
            f"{tier} tier: an inline 'secret' is refused: tier configs land in argv and logs. "
            "Put it in an environment variable ('secret_env': NAME) or a file only you can read "
            "('secret_file': PATH); `kvtier secret new` prints a fresh one"
        )
    raw = load_private_value(tier, "secret", env=secret_env, file=secret_file)
    if raw is not None and len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{tier} tier: the secret is shorter than {MIN_SECRET_BYTES} bytes; "
            "`kvtier secret new` prints one long enough"
        )
    if raw is not None:
        value = _secret_bytes(raw)
        needed = min(MIN_DISTINCT_BYTES, len(value) // 2 + 1)
        if len(set(value)) < needed:
            raise ConfigError(
                f"{tier} tier: the secret is obviously weak (fewer than {needed} distinct bytes, "
                "such as one byte repeated or a few cycled); `kvtier secret new` prints a random one"
            )
    return raw


def _secret_bytes(raw: bytes) -> bytes:
    """The bytes a secret stands for, as far as its strength goes: hex digits decoded (64 hex
    digits of `new_secret` are at most 16 distinct characters, often fewer, but 32 bytes that
    are nearly all distinct), anything else as it is."""
    try:
        return bytes.fromhex(raw.decode("ascii"))
    except ValueError:  # UnicodeDecodeError included
        return raw


def load_private_value(tier: str, what: str, *, env: object = None, file: object = None) -> bytes | None:
    """A private value (a secret, a password) from the environment variable `env` or the file
    `file` (`<what>_env` / `<what>_file` in a tier config), stripped of surrounding whitespace;
    None when neither is given. The file must be a regular file of ours that nobody else may
    read or write, reached without following a symlink at its last component."""
    if env is not None and file is not None:
        raise ConfigError(f"{tier} tier: give '{what}_env' or '{what}_file', not both")
    if env is not None:
        if not isinstance(env, str) or not env:
            raise ConfigError(f"{tier} tier: {what}_env must name an environment variable")
        raw = os.environb.get(os.fsencode(env))
        if raw is None:
            raise ConfigError(f"{tier} tier: the environment variable {env!r} ({what}_env) is not set")
        return raw.strip()
    if file is not None:
        if not isinstance(file, (str, os.PathLike)) or not os.fspath(file):
            raise ConfigError(f"{tier} tier: {what}_file must be a file path")
        return _read_private_file(tier, what, os.fspath(file))
    return None


def _read_private_file(tier: str, what: str, path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{tier} tier: cannot open {what}_file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{tier} tier: {what}_file {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ConfigError(f"{tier} tier: {what}_file {path} belongs to another user")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"{tier} tier: {what}_file {path} is open to group or others "
                f"(mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it"
            )
        if info.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(f"{tier} tier: {what}_file {path} is longer than {MAX_SECRET_FILE_BYTES} bytes")
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != info.st_size:  # a /proc or /sys file says it is empty, and holds text
        raise ConfigError(
            f"{tier} tier: {what}_file {path} is not a regular file (it holds other than its size "
            "says: a /proc or /sys file?)"
        )
    return data.strip()
