"""What a fresh interpreter sees: the chained block hash does not depend on PYTHONHASHSEED (the
gateways and the schedulers must agree on it), and the command line runs as a module."""

from __future__ import annotations

import subprocess
import sys

from radixserve.common.block_hash import block_hashes


def test_hash_is_the_same_in_another_process():
    code = "from radixserve.common.block_hash import block_hashes; print(block_hashes(range(64), 'm', 16))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout
    assert out.strip() == str(block_hashes(range(64), "m", 16))


def test_cli_runs_as_module():
    r = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "make-demo-model", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "--arch" in r.stdout
