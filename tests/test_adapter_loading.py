"""The core loads adapters generically, from the entry points of the group `hf_tpu.adapters`: it names
none of them, and one that fails to load is a warning, never a broken `import hf_tpu`."""

import os
import re
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "hf_tpu"


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))


def test_the_core_imports_no_adapter_patch_or_command_line():
    imports = re.compile(r"^\s*(from|import)\s+\S*(integrations|model_patches|cli|transformers|diffusers|accelerate)\b",
                         re.MULTILINE)
    offenders = [str(path.relative_to(CORE)) for path in CORE.rglob("*.py") if imports.search(path.read_text())]
    assert offenders == []


def test_import_hf_tpu_installs_the_hugging_face_adapters_through_their_entry_point():
    r = _python("import sys, hf_tpu\n"
                "print(any(type(f).__module__ == 'hf_tpu.integrations' for f in sys.meta_path))\n"
                "print(sorted(m for m in sys.modules if m.startswith(('hf_tpu.cli', 'hf_tpu.model_patches', "
                "'transformers', 'diffusers', 'accelerate'))))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True", "[]"]


def test_an_adapter_that_fails_to_load_is_a_warning(tmp_path):
    info = tmp_path / "broken_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hf_tpu.adapters]\nbroken = broken_adapter_module:activate\n")
    (tmp_path / "broken_adapter_module.py").write_text("raise RuntimeError('this adapter cannot load')\n")
    r = _python("import sys, torch, hf_tpu\n"
                "print(torch.ones(2, device='tpu').sum().item())\n"
                "print(any(type(f).__module__ == 'hf_tpu.integrations' for f in sys.meta_path))",
                PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2.0", "True"]
    assert "hf_tpu: the adapter 'broken' (broken_adapter_module:activate) could not be loaded" in r.stderr
    assert "this adapter cannot load" in r.stderr
