"""Where the commands that write the repository's files (`hf-tpu compat --write-docs`, `hf-tpu sweep --write`)
write: into the repository checkout when hf-tpu is an editable install of one, and nowhere by default
otherwise. A normal install has its package in site-packages, and writing there would change the
installed package instead of anything the user keeps; those commands then ask for an explicit path."""

from __future__ import annotations

from pathlib import Path


def package_root() -> Path:
    """The folder above `model_patches/`: the repository root in an editable install, site-packages'
    `hf_tpu/` in a normal one."""
    from hf_tpu import model_patches

    return Path(model_patches.__file__).resolve().parents[1]


def checkout_file(relative: str) -> Path | None:
    """`relative` in the repository checkout this package is an editable install of, or None when it is
    not one (no pyproject.toml beside the package's folders) or the checkout lacks the file."""
    root = package_root()
    if not (root / "pyproject.toml").is_file():
        return None
    path = root / relative
    return path if path.is_file() else None


def not_a_checkout(command: str, relative: str, option: str) -> int:
    """Says why `command` writes nothing, on stderr as argparse words an error; the exit status 2."""
    import sys

    print(f"hf-tpu {command}: error: this hf-tpu is not an editable install of a repository checkout, so there "
          f"is no {relative} to update (writing into the installed package is refused); "
          f"pass {option} PATH to choose the file", file=sys.stderr)
    return 2
