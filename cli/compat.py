"""`hf-tpu compat`: the per-architecture compatibility table (`model_patches/table.json`), printed or
written into docs/compatibility.md."""

from __future__ import annotations


GENERATED_BEGIN = "<!-- BEGIN ARCHITECTURES: generated from model_patches/table.json by `hf-tpu compat --write-docs` -->"
GENERATED_END = "<!-- END ARCHITECTURES -->"


DOCS_FILE = "docs/compatibility.md"


def _docs_path():
    """The checkout's docs/compatibility.md, or None when hf-tpu is not an editable install of a checkout."""
    from . import _checkout

    return _checkout.checkout_file(DOCS_FILE)


def docs_with_table(text: str, table_markdown: str) -> str:
    """The compatibility page with its generated section replaced by `table_markdown`."""
    head, begin, rest = text.partition(GENERATED_BEGIN)
    _, end, tail = rest.partition(GENERATED_END)
    if not begin or not end:
        raise SystemExit(f"the compatibility page lacks the markers {GENERATED_BEGIN!r} ... {GENERATED_END!r}")
    return f"{head}{GENERATED_BEGIN}\n{table_markdown}{GENERATED_END}{tail}"


def run(args) -> int:
    from hf_tpu import model_patches

    table_markdown = model_patches.render_markdown()
    if args.write_docs:
        path = args.docs or _docs_path()
        if path is None:
            from . import _checkout

            return _checkout.not_a_checkout("compat", DOCS_FILE, "--docs")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(docs_with_table(text, table_markdown))
        print(f"wrote the architecture table to {path}")
    elif args.markdown:
        print(table_markdown, end="")
    else:
        table = model_patches.load_table()
        for model_type, entry in sorted(table["architectures"].items()):
            patches = f" [patches: {', '.join(entry['patches'])}]" if entry["patches"] else ""
            limits = f"  {entry['limits']}" if entry["limits"] else ""
            print(f"{model_type:<28} {entry['status']:<19} {entry['checked']}{patches}{limits}")
        print(f"({len(table['not_checked'])} not checked: their tiny config fails on CPU; see --markdown)")
    return 0
