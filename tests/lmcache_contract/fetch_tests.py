"""Fetch the tests of LMCache's source distribution, which its wheel does not carry.

    python tests/lmcache_contract/fetch_tests.py DEST

Downloads `lmcache-<version>.tar.gz` with pip, from wherever this machine's pip finds packages
(its configured index, mirrors, proxy and certificates: nothing here names a host), checks it
against the release's sha256, and unpacks its `tests/`, `pytest.ini` and the external-adapter
example into DEST (the sources of the package itself stay out: they would shadow the
installed, compiled LMCache). Does nothing if DEST already holds them. tests/install.sh runs
it; tests/test_lmcache_contract.py runs those tests against our adapter.

pip prepares a source distribution's metadata before it keeps it, in an environment with the
package's build requirements (torch among them: a few minutes, once). LMCache's setup would
compile its native extensions for that, and fail without CUDA, unless NO_NATIVE_EXT=1 is set.
`--no-binary` names LMCache alone: `:all:` would also make pip build those requirements
(torch) from their sources.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.5.6"
#: The sha256 of lmcache-0.5.6.tar.gz as released: a mirror serves the same bytes.
SDIST_SHA256 = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"
KEEP = ("tests/", "pytest.ini", "examples/lmc_external_l2_adapter/")


def download(into: Path) -> Path:
    """LMCache's source distribution, downloaded by pip into `into`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "lmcache"]
    command += ["--dest", str(into), f"lmcache=={VERSION}"]
    subprocess.run(command, check=True, env={**os.environ, "NO_NATIVE_EXT": "1"})
    return into / f"lmcache-{VERSION}.tar.gz"


def main() -> None:
    dest = Path(sys.argv[1])
    if (dest / "pytest.ini").exists():
        return
    with tempfile.TemporaryDirectory(prefix="lmcache-sdist-") as work:
        sdist = download(Path(work))
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise SystemExit(
                f"fetch_tests: {sdist.name} has sha256 {digest}, not the release's {SDIST_SHA256}"
            )
        prefix = f"lmcache-{VERSION}/"
        with tarfile.open(sdist, mode="r:gz") as archive:
            members = []
            for member in archive.getmembers():
                inner = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
                if inner.startswith(KEEP) and (member.isfile() or member.isdir()):
                    member.name = inner
                    members.append(member)
            archive.extractall(dest, members=members, filter="data")


if __name__ == "__main__":
    main()
