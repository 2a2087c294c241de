"""vLLM's CPU runtime settings (serve/cpu_runtime.py): what goes into the engine's environment."""

from pathlib import Path

import pytest

from online_opd.config import ConfigError, load_config
from serve.cpu_runtime import cpu_runtime_env, find_libiomp

IOMP = Path("/opt/venv/lib/libiomp5.so")


def test_iomp_is_preloaded_and_cores_unreserved():
    env = cpu_runtime_env("iomp", 0, environ={}, libiomp=IOMP)
    assert env == {"LD_PRELOAD": str(IOMP), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_iomp_goes_before_other_preloads():
    env = cpu_runtime_env("iomp", None, environ={"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}, libiomp=IOMP)
    assert env == {"LD_PRELOAD": f"{IOMP}:/usr/lib/libtcmalloc.so"}


@pytest.mark.parametrize("preload", ["/x/libgomp.so.1", "/y/libiomp5.so", "/z/libomp.so"])
def test_a_users_openmp_preload_is_kept(preload):
    assert cpu_runtime_env("iomp", None, environ={"LD_PRELOAD": preload}, libiomp=IOMP) == {}


def test_gomp_adds_nothing_and_a_users_reservation_is_kept():
    environ = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert cpu_runtime_env("gomp", 0, environ=environ, libiomp=IOMP) == {}
    assert cpu_runtime_env("gomp", None, environ={}, libiomp=IOMP) == {}


def test_missing_libiomp_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr("serve.cpu_runtime.find_libiomp", lambda: None)
    assert cpu_runtime_env("iomp", 0, environ={}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert "libiomp5.so not found" in caplog.text


def test_the_install_ships_libiomp():
    """vllm-cpu depends on intel-openmp, whose wheel puts libiomp5.so under <venv>/lib."""
    lib = find_libiomp()
    assert lib is not None and lib.name == "libiomp5.so"


def test_config_rejects_unknown_openmp(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cpu:\n  openmp: tbb\n")
    with pytest.raises(ConfigError, match="openmp"):
        load_config(path)
