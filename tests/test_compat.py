"""mamba3_mimo.compat: upstream's import path answers with this package's operator after
install(), only where no real mamba_ssm is installed unless force=True; idempotent; uninstall()
restores sys.modules; code that resolves the import at its own import time (as
flash-linear-attention's Mamba3 layer does) sees the operator when install() comes first."""
import importlib
import sys
import textwrap

import pytest

from mamba3_mimo import compat, mamba3_mimo


@pytest.fixture(autouse=True)
def clean_modules():
    """Each test starts and ends without compat's modules or a mamba_ssm."""
    compat.uninstall()
    before = {k for k in sys.modules if k == "mamba_ssm" or k.startswith("mamba_ssm.")}
    assert not before, before
    yield
    compat.uninstall()
    for name in [k for k in sys.modules if k == "mamba_ssm" or k.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_install_and_uninstall():
    with pytest.raises(ImportError):
        importlib.import_module(compat.TARGET)
    assert compat.install() and compat.installed()
    from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo as op
    assert op is mamba3_mimo
    module = sys.modules[compat.TARGET]
    assert compat.install() and sys.modules[compat.TARGET] is module  # idempotent
    compat.uninstall()
    assert not compat.installed()
    assert not any(k == "mamba_ssm" or k.startswith("mamba_ssm.") for k in sys.modules)
    with pytest.raises(ImportError):
        importlib.import_module(compat.TARGET)
    assert compat.install() and importlib.import_module(compat.TARGET).mamba3_mimo is mamba3_mimo


def _fake_upstream(tmp_path, monkeypatch):
    """A real-looking mamba_ssm on sys.path whose operator module is not ours."""
    pkg = tmp_path / "mamba_ssm" / "ops" / "tilelang" / "mamba3"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent, pkg.parent.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "mamba3_mimo.py").write_text("def mamba3_mimo(*args, **kwargs):\n    return 'upstream'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_real_upstream_is_left_alone_unless_forced(tmp_path, monkeypatch):
    _fake_upstream(tmp_path, monkeypatch)
    assert not compat.install() and not compat.installed()
    assert importlib.import_module(compat.TARGET).mamba3_mimo() == "upstream"
    assert compat.install(force=True) and compat.installed()
    import mamba_ssm.ops.tilelang.mamba3 as parent
    assert parent.__file__ is not None  # upstream's package kept, only the operator replaced
    assert sys.modules[compat.TARGET].mamba3_mimo is mamba3_mimo
    compat.uninstall()
    assert sys.modules[compat.TARGET].mamba3_mimo() == "upstream"


def test_import_time_resolution_sees_the_operator(tmp_path, monkeypatch):
    """A module that imports upstream's path when it is imported, in a try/except as
    flash-linear-attention's fla/layers/mamba3.py does: after install() it holds our operator;
    imported before install(), it holds None (docs: install() first)."""
    (tmp_path / "client_layer.py").write_text(textwrap.dedent("""
        try:
            from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo as op
        except ImportError:
            op = None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    import client_layer
    assert client_layer.op is None
    del sys.modules["client_layer"]
    compat.install()
    import client_layer as again
    assert again.op is mamba3_mimo
    del sys.modules["client_layer"]
