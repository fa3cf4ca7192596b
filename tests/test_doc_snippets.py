"""Every ```python block of the README and the user's guide runs, as the notebooks do (tests/test_notebooks.py):
each document in a process of its own, on the CPU's virtual TPU with two simulated chips, by the conventions of
`tests/doc_snippets.py` (a section's blocks in one fresh namespace; `<!-- before running: ... -->` defines what
the text takes from the reader, such as a checkpoint's `path`, with tiny models; `<!-- not run: ... -->` leaves
out a block, saying why). Each leaves nothing in the temp dir."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_snippets import sections
from tests.util import cpu_process_env

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/guide.md"]


def _blocks(document: str) -> list:
    return [block for section in sections((ROOT / document).read_text()) for block in section.blocks]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_python_block_runs(document, tmp_path):
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    env = cpu_process_env(TMPDIR=str(temp_dir), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"),
                          HF_TPU_NUM_DEVICES="2")
    result = subprocess.run([sys.executable, "-m", "tests.doc_snippets", document], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    ran = [line for line in result.stdout.splitlines() if line.startswith("ran ")]
    assert len(ran) == sum(not block.not_run for block in _blocks(document)), result.stdout
    assert list(temp_dir.iterdir()) == [], "the blocks left files in the temp dir"


def test_the_blocks_left_out_are_few_and_say_why():
    left_out = [block.not_run for document in DOCUMENTS for block in _blocks(document) if block.not_run]
    assert 0 < len(left_out) <= 3 and all(left_out), left_out


def test_the_conventions_of_the_markdown_source():
    text = "\n".join([
        "# A", "```python", "a = 1", "```", "text", "```bash", "not python", "```",
        "<!-- before running: path = 'x' -->", "```python", "b = a", "```",
        "## B", "<!-- not run: needs several hosts -->", "```python", "c = 1", "```",
        "<!-- a comment -->", "with text after it", "```python", "d = 1", "```",
    ])
    found = sections(text)
    assert [section.title for section in found] == ["A", "B"]
    a, b = found[0].blocks, found[1].blocks
    assert [(block.code, block.line, block.setup, block.not_run) for block in a] == [
        ("a = 1", 3, "", ""), ("b = a", 11, "path = 'x'", "")]
    assert [(block.code, block.not_run) for block in b] == [("c = 1", "needs several hosts"), ("d = 1", "")]
    with pytest.raises(ValueError, match="without a reason"):
        sections("<!-- not run: -->\n```python\nx = 1\n```")
