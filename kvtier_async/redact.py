"""`redact_url`: a URL or endpoint a tier accepts, as it may be shown (stats, logs, errors, repr,
the CLI's output): without the credentials it may carry; `redacted_config`: a whole tier config.

It works on the text, malformed URLs included, and judges names as the client that reads them
does, decoded: redis-py percent-decodes query names, so `?pass%77ord=PW` gives the password
`PW` exactly as `?password=PW` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote_plus

__all__ = ["redact_url", "redacted_config"]

#: A query parameter whose (decoded) name says it carries a credential.
_CREDENTIAL_NAME = re.compile(r"pass|pwd|secret|token|auth|credential|signature|key", re.IGNORECASE)
#: Where a query parameter starts: after '?', '&' or ';'.
_PARAMETER = re.compile(r"[?&;]([^=&;#]*)=")


def redact_url(url: str) -> str:
    """The URL without its credentials: from the first query parameter whose decoded name
    names a credential, all that follows it (a password with an unencoded '&' would otherwise
    show its tail), and everything of the user-info part but a user name (a password with an
    unencoded '/', '#' or '@' is not parsed as one, so the last '@' anywhere ends it)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    for parameter in _PARAMETER.finditer(rest):
        if _CREDENTIAL_NAME.search(unquote_plus(parameter.group(1))):
            rest = rest[: parameter.end()] + "***"
            break
    if "@" in rest:
        userinfo, host = rest.rsplit("@", 1)
        # A user name ends at the first ':' (a password may hold one); without a ':' the whole
        # part may be a password given as a user name: hidden too.
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        rest = (f"{user}:***@" if user and "/" not in user and "%" not in user else "***@") + host
    return scheme + sep + rest


#: Tier config fields never shown: credentials given inline, and objects whose repr may hold them.
_HIDDEN_FIELDS = frozenset({"secret_access_key", "access_key_id", "password", "secret", "client", "store"})
#: Tier config fields that are URLs or endpoints.
_URL_FIELDS = ("url", "endpoint")


def redacted_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A tier config as it may be shown: inline credentials hidden, URLs redacted."""
    out = {k: ("***" if k in _HIDDEN_FIELDS else v) for k, v in config.items()}
    for name in _URL_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = redact_url(out[name])
    return out
