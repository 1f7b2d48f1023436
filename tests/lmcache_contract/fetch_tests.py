"""Fetch the tests of LMCache's source distribution, which its wheel does not carry.

    python tests/lmcache_contract/fetch_tests.py DEST

Downloads `lmcache-<version>.tar.gz` from PyPI (checked against the digest the index gives),
and unpacks its `tests/`, `pytest.ini` and the external-adapter example into DEST (the sources
of the package itself stay out: they would shadow the installed, compiled LMCache). Does
nothing if DEST already holds them. tests/install.sh runs it; tests/test_lmcache_contract.py
runs those tests against our adapter.
"""

from __future__ import annotations

import hashlib
import io
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.5.6"
INDEX = "https://pypi.org/simple/lmcache/"
KEEP = ("tests/", "pytest.ini", "examples/lmc_external_l2_adapter/")


def main() -> None:
    dest = Path(sys.argv[1])
    if (dest / "pytest.ini").exists():
        return
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    found = re.search(rf'href="([^"#]*lmcache-{re.escape(VERSION)}\.tar\.gz)#sha256=([0-9a-f]{{64}})"', page)
    if found is None:
        raise SystemExit(f"fetch_tests: no lmcache-{VERSION}.tar.gz on {INDEX}")
    url, digest = found.groups()
    data = urllib.request.urlopen(url, timeout=300).read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"fetch_tests: {url} does not match its sha256 {digest}")
    prefix = f"lmcache-{VERSION}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        members = []
        for member in archive.getmembers():
            inner = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
            if inner.startswith(KEEP) and (member.isfile() or member.isdir()):
                member.name = inner
                members.append(member)
        archive.extractall(dest, members=members, filter="data")


if __name__ == "__main__":
    main()
