"""The ```python blocks of a Markdown document (the README, docs/guide.md), run as a reader would run them.

Conventions of the Markdown source:

- A section (the text under one heading, of any level) is read on its own: its blocks run in order in one
  fresh namespace, each seeing what the blocks before it in the section defined.
- `<!-- before running: CODE -->` just before a block runs CODE first, in the block's namespace, to define what
  the text takes from the reader's own work (a checkpoint `path`, a `model`); `doc_setup` there is this
  module's `Setup`, which makes tiny models in a temporary folder.
- `<!-- not run: REASON -->` just before a block leaves it out, for a reason the source states (the Hub,
  several hosts).

Run: python -m tests.doc_snippets DOCUMENT.md [SECTION ...]   (default: every section)
It prints one line per block and exits with the first block's error, its traceback naming the document's lines.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
_MARKER = re.compile(r"^<!--\s*(before running|not run):\s*(.*?)\s*-->$", re.DOTALL)


@dataclasses.dataclass
class Block:
    """One ```python block: its code, the document line its code starts at, and its marker's instructions."""

    code: str
    line: int
    setup: str = ""
    not_run: str = ""


@dataclasses.dataclass
class Section:
    title: str
    blocks: list


def sections(text: str) -> list[Section]:
    """The sections of a Markdown text that hold ```python blocks, in order."""
    found, title, lines = [], "", text.splitlines()
    pending_comment, index = None, 0
    while index < len(lines):
        line = lines[index]
        heading = _HEADING.match(line)
        fence = _FENCE.match(line)
        if heading:
            title, pending_comment = heading[1], None
        elif line.startswith("<!--"):
            end = next(k for k in range(index, len(lines)) if lines[k].rstrip().endswith("-->"))
            pending_comment = "\n".join(lines[index:end + 1])
            index = end
        elif fence:
            end = next(k for k in range(index + 1, len(lines)) if lines[k].startswith("```"))
            if fence[1] == "python":
                block = Block("\n".join(lines[index + 1:end]), index + 2)
                marker = _MARKER.match(pending_comment.strip()) if pending_comment else None
                if marker and marker[1] == "not run":
                    if not marker[2]:
                        raise ValueError(f"line {index + 1}: `not run` without a reason")
                    block.not_run = marker[2]
                elif marker:
                    block.setup = marker[2]
                if not found or found[-1].title != title:
                    found.append(Section(title, []))
                found[-1].blocks.append(block)
            index, pending_comment = end, None
        elif line.strip():
            pending_comment = None
        index += 1
    return found


class Setup:
    """What `<!-- before running: ... -->` markers call (as `doc_setup`): tiny models, saved in a temporary
    folder removed when the process ends, in place of the reader's checkpoints."""

    folder = None

    @classmethod
    def _directory(cls) -> str:
        import tempfile

        if cls.folder is None:
            cls.folder = tempfile.TemporaryDirectory(prefix="doc-snippets-")
        return cls.folder.name

    @classmethod
    def causal_lm(cls):
        """(the folder of a tiny Llama checkpoint with its tokenizer, a batch of one prompt's token ids): one
        layer, the fewest programs to compile."""
        import torch

        from examples.tiny_llama import save_tiny_llama

        return save_tiny_llama(cls._directory(), small=True, num_hidden_layers=1), torch.tensor([[1, 40, 41, 42, 43]])

    @classmethod
    def new_folder(cls, name: str) -> str:
        """A new empty folder for what a block saves (a quantized checkpoint)."""
        import os

        folder = os.path.join(cls._directory(), name)
        os.makedirs(folder)
        return folder

    @classmethod
    def stable_diffusion(cls) -> str:
        """The folder of a tiny Stable Diffusion pipeline (16x16 images)."""
        from examples.text_to_image import saved_pipeline

        return saved_pipeline("sd", cls._directory())

    @staticmethod
    def training():
        """(a model, its optimizer, a DataLoader of its batches), as a training script has them."""
        import torch

        model = torch.nn.Linear(8, 1)
        data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
        return model, torch.optim.AdamW(model.parameters()), torch.utils.data.DataLoader(data, batch_size=4)

    @staticmethod
    def gelu_kernel():
        """A JAX function for `aten.gelu`'s tanh form, standing in for a Pallas kernel of the reader's."""
        import jax

        return lambda x, approximate="tanh": jax.nn.gelu(x, approximate=True)


def run(path: Path, titles=()) -> None:
    """Run the blocks of the sections of `path` (those named in `titles`, or all)."""
    for section in sections(path.read_text()):
        if titles and section.title not in titles:
            continue
        namespace = {"__name__": "__main__"}
        for block in section.blocks:
            where = f"{path}:{block.line}"
            if block.not_run:
                print(f"not run  {where} ({block.not_run})", flush=True)
                continue
            started = time.perf_counter()
            if block.setup:
                namespace["doc_setup"] = Setup
                exec(compile(block.setup, f"{where} (before running)", "exec"), namespace)
                del namespace["doc_setup"]
            # padded to its place in the document: a traceback names the document's lines
            exec(compile("\n" * (block.line - 1) + block.code, str(path), "exec"), namespace)
            print(f"ran      {where} in {time.perf_counter() - started:.1f} s ({section.title})", flush=True)


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
