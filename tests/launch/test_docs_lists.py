"""The prose's lists of registered names stay equal to the registries (src/arbor/registry.py).

A list of a family's names in README.md, docs/*.md or skills/*/SKILL.md is marked,
`<!-- registry: LOSSES -->`ppo_clip`, ...<!-- /registry -->`, and holds exactly the registry's names (in any order;
the names are the only words in backticks inside the markers). An unmarked paragraph that names three or more of a
family's members in backticks must name them all, so no sentence outside a marked list claims a partial list. Adding a
family is one line in FAMILIES.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from arbor import registry

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "skills").glob("*/SKILL.md"))]

FAMILIES = [
    "LOSSES",
    "ADVANTAGES",
    "ENVIRONMENTS",
    "BACKENDS",
    "MODES",
    "MODEL_FAMILIES",
]
"""The registries of src/arbor/registry.py whose names the prose lists, one line each."""

MARKED = re.compile(r"<!-- registry: (\w+) -->(.*?)<!-- /registry -->", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
NAME = re.compile(r"`([A-Za-z0-9_.:-]+)`")
PARTIAL_THRESHOLD = 3
"""An unmarked paragraph naming this many members of a family is read as a list of them."""


def names(family: str) -> set[str]:
    return set(getattr(registry, family).names())


def marked_lists(text: str) -> list[tuple[str, set[str]]]:
    return [(m.group(1), set(NAME.findall(m.group(2)))) for m in MARKED.finditer(text)]


def unmarked_paragraphs(text: str) -> list[str]:
    """Prose paragraphs (code fences dropped) with the marked lists cut out."""
    return [p for p in re.split(r"\n\s*\n", MARKED.sub("", FENCE.sub("", text))) if p.strip()]


def test_the_table_names_registries():
    for family in FAMILIES:
        assert isinstance(getattr(registry, family), registry.Registry), family


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_a_marked_list(family):
    found = [doc for doc in DOCS if any(f == family for f, _ in marked_lists(doc.read_text()))]
    assert found, f"no `<!-- registry: {family} -->` list in README.md, docs/ or skills/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_marked_lists_equal_their_registry(doc):
    for family, listed in marked_lists(doc.read_text()):
        assert family in FAMILIES, f"{doc.name}: marked list of unknown family {family}"
        want = names(family)
        assert listed == want, (
            f"{doc.relative_to(ROOT)}: the {family} list misses {sorted(want - listed)}, "
            f"lists unregistered {sorted(listed - want)}"
        )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unmarked_partial_lists(doc):
    for paragraph in unmarked_paragraphs(doc.read_text()):
        mentioned = set(NAME.findall(paragraph))
        for family in FAMILIES:
            want = names(family)
            hit = mentioned & want
            assert len(hit) < PARTIAL_THRESHOLD or hit == want, (
                f"{doc.relative_to(ROOT)}: a paragraph lists {sorted(hit)} of {family} but not "
                f"{sorted(want - hit)}; mark the list (<!-- registry: {family} -->) or name them all:\n"
                f"{paragraph[:300]}"
            )


def test_the_checks_catch_drift():
    """The parsers on a made-up page: a short marked list and an unmarked partial one are both found."""
    text = "Losses: <!-- registry: LOSSES -->`gspo`<!-- /registry -->.\n\nPick `ppo_clip`, `gspo` or `cispo`.\n"
    assert marked_lists(text) == [("LOSSES", {"gspo"})]
    (paragraph,) = [p for p in unmarked_paragraphs(text) if "Pick" in p]
    assert set(NAME.findall(paragraph)) & names("LOSSES") == {"ppo_clip", "gspo", "cispo"}
