"""MkDocs hook: the site's home page is the repository's README.md, so the two cannot differ.

Its links into docs/ (`docs/quickstart.md`) are rewritten to the site's (`quickstart.md`);
`mkdocs build --strict` then fails on a README link to a page that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_as_index(text: str) -> str:
    return re.sub(r"\]\(docs/", "](", text)


def on_files(files, config):
    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", content=readme_as_index(README.read_text())))
    return files
