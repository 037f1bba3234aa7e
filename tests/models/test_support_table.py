"""docs/models.md's support table equals the one the families declare (arbor.models.support): every native
architecture, and every transformers family the tests build (tests/hf_tiny.py)."""

from __future__ import annotations

import re
from pathlib import Path

from hf_tiny import MORE_HF, TINY_HF, tiny_config

from arbor.models.families.transformers import TRANSFORMERS
from arbor.models.support import support_row, support_table
from arbor.registry import MODEL_FAMILIES

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BLOCK = re.compile(r"<!-- support-table -->\n(.*?)\n<!-- /support-table -->", re.S)


def expected_table() -> str:
    rows = [support_row(arch, MODEL_FAMILIES.load(arch)) for arch in MODEL_FAMILIES.names()]
    for arch in [*TINY_HF, *MORE_HF]:
        args = TRANSFORMERS.from_hf_config(tiny_config(arch).to_dict())
        rows.append(support_row(arch, TRANSFORMERS, args))
    return support_table(rows)


def test_the_docs_support_table_is_the_generated_one():
    found = BLOCK.search(DOC.read_text())
    assert found, "docs/models.md has no <!-- support-table --> block"
    assert found.group(1) == expected_table(), "regenerate it: print(expected_table()) in this test module"
