"""The documentation holds together: the site builds, every link lands, the README stays a
way in, the generated references match the code, and the examples the pages show work.

The README was once 2,306 lines, and what moved out of it must not rot where it went:
a broken link or a stale default in the docs misleads as much as one in the README did.
(Blocks a page marks to run are run by ``tests/test_readme_blocks.py``.)
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from markdown.extensions.toc import slugify

from gossipd.coordinator.config import parse_coordinator_config
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.shared.config import LinkConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
README_MAX_LINES = 300
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _gen_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _headings(page: Path) -> list[str]:
    """The text of every heading of ``page`` as a renderer sees it (markup stripped)."""
    titles = re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), re.M)
    plain = [re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title) for title in titles]
    return [title.replace("`", "").replace("*", "") for title in plain]


def _github_slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Anchors that work both on GitHub and in the built site (mkdocs' toc slugs)."""
    titles = _headings(page)
    return {slugify(t, "-") for t in titles} & {_github_slug(t) for t in titles}


def _links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(_prose(page.read_text()))]


# -- the site --------------------------------------------------------------------------------
def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    """Strict: a page missing from the nav, a link to a missing page or anchor fails it."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "design.html").exists()


def test_the_nav_lists_every_page() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")]
    missing = [page for page in pages if f": {page}\n" not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


# -- links -----------------------------------------------------------------------------------
def test_the_link_check_sees_links_and_anchors() -> None:
    # Without this, a pattern that matched nothing would pass every link test below.
    links = _links()
    assert (ROOT / "README.md", "docs/operator.md#certificates") in links
    assert "certificates" in _anchors(DOCS / "operator.md")
    assert "2-the-shape-of-the-code-protocol-cores-are-pure" in _anchors(DOCS / "design.md")


def test_every_relative_link_reaches_a_file_and_its_heading() -> None:
    broken = []
    for page, target in _links():
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents:
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_top_level_docs_page() -> None:
    """The README is the way in: a page it does not name is one a reader never finds."""
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for page, target in _links()
        if page.name == "README.md" and target.startswith("docs/")
    }
    pages = {p.resolve() for p in DOCS.glob("*.md")} | {
        (DOCS / sub / "index.md").resolve() for sub in ("protocols", "benchmarks")
    }
    unlinked = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not unlinked, f"README.md links none of: {unlinked}"


# -- the README ------------------------------------------------------------------------------
def test_the_readme_stays_under_300_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_readme_first_paragraph_names_every_protocol_and_feature() -> None:
    first = (ROOT / "README.md").read_text().split("\n\n")[1]
    for name in (
        "sumweight",
        "crossover",
        "pushsum-expgraph",
        "shuffle-exchange",
        "persyn",
        "overlap",
        "coordinator",
        "MQTT",
        "mutual TLS",
        "Prometheus",
        "Grafana",
        "ranks",
    ):
        assert name in first, f"the README's first paragraph does not mention {name}"


def test_the_readme_site_config_is_a_valid_config() -> None:
    readme = (ROOT / "README.md").read_text()
    [block] = [b for b in readme.split("```toml\n")[1:] if b.startswith("# site.toml")]
    config = parse_config(tomllib.loads(block.split("```")[0]), "README site.toml")
    assert config.node_id == "hospital-a" and config.tls.ca is not None


# -- the generated references ----------------------------------------------------------------
def test_the_reference_pages_are_what_the_generator_makes_from_the_code() -> None:
    stale = _gen_reference().stale_pages()
    assert not stale, (
        f"{[str(p.relative_to(ROOT)) for p in stale]} differ from the code: run "
        "python docs/gen_reference.py and commit the pages"
    )


def test_the_generator_refuses_a_note_for_a_key_the_config_lacks() -> None:
    gen = _gen_reference()
    notes = tomllib.loads(gen.NOTES.read_text())
    notes["config"]["keys"]["gossip.no_such_key"] = "a note nothing reads"
    with pytest.raises(gen.ReferenceError, match=r"gossip\.no_such_key"):
        gen.config_page(notes)


def test_the_generator_refuses_a_labels_note_that_misses_a_label() -> None:
    gen = _gen_reference()
    notes = tomllib.loads(gen.NOTES.read_text())
    notes["metrics"]["names"]["gossipd_gossip_bytes_total"]["labels"] = "`direction`, `kind`"
    with pytest.raises(gen.ReferenceError, match="gossipd_gossip_bytes_total"):
        gen.metrics_page(notes)


# -- examples the pages show (moved from the README with their text) ---------------------------
def test_the_coordinator_page_example_is_a_valid_coordinator_config() -> None:
    page = (DOCS / "coordinator.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    parsed = parse_coordinator_config(tomllib.loads(example), "docs/coordinator.md coord.toml")
    assert parsed.mesh_id == "lab-mesh"


def test_the_shaping_page_link_example_is_a_valid_config_that_shapes() -> None:
    page = (DOCS / "benchmarks" / "shaping.md").read_text()
    [block] = [b for b in page.split("```toml\n")[1:] if b.startswith("[link]")]
    table = tomllib.loads(block.split("```")[0])
    config = parse_config({"mesh_id": "m", "node_id": "n0", "tls": {"insecure": True}, **table})
    shaper = LinkShaper.from_config(config.link, "n0")
    assert shaper is not None and shaper.latency_s == 0.05 and shaper.rate_bytes_s == 12.5e6
    reference = (DOCS / "reference" / "config.md").read_text()
    for key in LinkConfig.model_fields:
        assert f"| `link.{key}` | `0`" in reference, f"link.{key} is not in the reference"


def test_the_containers_page_gives_the_gpu_command_and_what_the_host_needs() -> None:
    page = (DOCS / "containers.md").read_text()
    section = page.split("## Multi-rank sites on GPUs", 1)[1].split("\n## ", 1)[0]
    up = "docker compose -f docker/compose.yaml -f docker/compose.gpu.yaml up --build"
    assert up in section and "`GOSSIPD_RANKS` (default 2)" in section
    assert "NVIDIA Container Toolkit" in section and "shm_size" in section


def test_the_operator_guide_site_config_is_a_valid_config() -> None:
    page = (DOCS / "operator.md").read_text()
    [block] = [b for b in page.split("```toml\n")[1:] if b.startswith("# site.toml")]
    config = parse_config(tomllib.loads(block.split("```")[0]), "docs/operator.md site.toml")
    assert config.mesh_id == "oncology-2026"
