"""The core package stands alone: every module under ``online_opd`` imports, and a set of the fast
core tests passes, in a process where vllm, ray and prometheus_client cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PACKAGES = ("vllm", "ray", "prometheus_client")
# fast tests of the core that cover the config, losses, records, models and speculative decoding
CORE_TESTS = ("tests/test_config.py", "tests/test_losses.py", "tests/test_records.py", "tests/test_specdec.py")

SCRIPT = """
import importlib, json, pkgutil, sys

BLOCKED = set(sys.argv[1].split(","))


class Unimportable:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is made unimportable by this test")
        return None


sys.meta_path.insert(0, Unimportable())
for name in BLOCKED:  # the finder works: an engine package does not import
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        sys.exit(f"{name} imported despite the finder")

import online_opd

names = [m.name for m in pkgutil.walk_packages(online_opd.__path__, "online_opd.")]
for name in names:
    importlib.import_module(name)
print(json.dumps(names))

import pytest

sys.exit(pytest.main(["-q", "-m", "not slow", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def test_online_opd_imports_and_its_core_tests_pass_without_vllm_ray_or_prometheus():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(ENGINE_PACKAGES), *CORE_TESTS], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = json.loads(proc.stdout.splitlines()[0])
    expected = {"online_opd." + ".".join(p.relative_to(ROOT / "online_opd").with_suffix("").parts)
                for p in (ROOT / "online_opd").rglob("*.py") if p.name != "__init__.py"}
    assert expected <= set(names)  # every module file was imported, not just the packages
    assert " passed" in proc.stdout.splitlines()[-1] and " failed" not in proc.stdout
