"""Title and main text of an HTML page.

- Main text: trafilatura (``bare_extraction`` with ``favor_recall=True``, tables kept, comments dropped).
- Title: the order Mozilla Readability uses (``Readability.js``: ``_getJSONLD``, ``_getArticleMetadata``,
  ``_getArticleTitle``): a JSON-LD ``Article``-like ``name``/``headline``, then the ``dc:title``,
  ``dcterm:title``, ``og:title``, ``weibo:*:title``, ``title``, ``twitter:title``, ``parsely-title`` meta
  tags, then the ``<title>`` element cleaned of site-name parts by Readability's separator rules.
"""

from __future__ import annotations

import json
import re

import lxml.html
import trafilatura
from lxml import etree

_SEPARATORS = r"|\-–—\\/>»"
_HIERARCHICAL = r"\\/>»"
_META_TITLE_KEYS = (
    "dc:title",
    "dcterm:title",
    "og:title",
    "weibo:article:title",
    "weibo:webpage:title",
    "title",
    "twitter:title",
    "parsely-title",
)
_ARTICLE_TYPES = re.compile(
    r"^(Article|AdvertiserContentArticle|NewsArticle|AnalysisNewsArticle|AskPublicNewsArticle|BackgroundNewsArticle|"
    r"OpinionNewsArticle|ReportageNewsArticle|ReviewNewsArticle|Report|SatiricalArticle|ScholarlyArticle|"
    r"MedicalScholarlyArticle|SocialMediaPosting|BlogPosting|LiveBlogPosting|DiscussionForumPosting|"
    r"TechArticle|APIReference)$"
)


def _squash(text: str) -> str:
    return " ".join(text.split())


def _word_count(text: str) -> int:
    return len(text.split())


def _jsonld_title(tree) -> str | None:
    for script in tree.iter("script"):
        if (script.get("type") or "").strip().lower() != "application/ld+json":
            continue
        raw = re.sub(r"^\s*<!\[CDATA\[|\]\]>\s*$", "", script.text or "")
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        items = data if isinstance(data, list) else data.get("@graph", [data]) if isinstance(data, dict) else []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("@type"), str):
                continue
            if _ARTICLE_TYPES.match(item["@type"]):
                for field in ("name", "headline"):
                    if isinstance(item.get(field), str) and item[field].strip():
                        return _squash(item[field])
    return None


def _meta_title(tree) -> str | None:
    values: dict[str, str] = {}
    for meta in tree.iter("meta"):
        content = meta.get("content")
        key = (meta.get("property") or meta.get("name") or "").strip().lower()
        if not content or not key:
            continue
        for name in key.split():
            values.setdefault(name.replace(".", ":"), _squash(content))
    return next((values[k] for k in _META_TITLE_KEYS if values.get(k)), None)


def _document_title(tree) -> str:
    """Readability's ``_getArticleTitle``: the ``<title>`` without its site-name part when that is safe."""
    title_el = tree.find(".//title")
    original = _squash(title_el.text_content()) if title_el is not None else ""
    current, hierarchical = original, False
    if re.search(f" [{_SEPARATORS}] ", current):
        hierarchical = bool(re.search(f" [{_HIERARCHICAL}] ", current))
        current = re.sub(f"(.*)[{_SEPARATORS}] .*", r"\1", original)  # drop the last part
        if _word_count(current) < 3:
            current = re.sub(f"[^{_SEPARATORS}]*[{_SEPARATORS}](.*)", r"\1", original)  # drop the first part
    elif ": " in current:
        headings = {_squash(h.text_content()) for h in tree.iter("h1", "h2")}
        if current not in headings:
            current = original[original.rfind(":") + 1 :]
            if _word_count(current) < 3:
                current = original[original.find(":") + 1 :]
            elif _word_count(original[: original.find(":")]) > 5:
                current = original
    elif len(current) > 150 or len(current) < 15:
        h1s = list(tree.iter("h1"))
        if len(h1s) == 1:
            current = h1s[0].text_content()
    current = _squash(current)
    words = _word_count(current)
    if words <= 4 and (not hierarchical or words != _word_count(re.sub(f"[{_SEPARATORS}]+", "", original)) - 1):
        current = original
    return current


def page_title(html: str) -> str:
    """The page's title (JSON-LD, then meta tags, then the cleaned ``<title>``); "" when there is none."""
    try:
        tree = lxml.html.fromstring(html)
    except (etree.ParserError, ValueError):
        return ""
    return _jsonld_title(tree) or _meta_title(tree) or _document_title(tree)


def extract_page(html: str, url: str | None = None) -> tuple[str, str]:
    """``(title, main text)`` of an HTML page; the text is "" when trafilatura finds no main content."""
    document = trafilatura.bare_extraction(
        html, url=url, favor_recall=True, include_tables=True, include_comments=False, with_metadata=False
    )
    text = document.text if document is not None and document.text else ""
    lines = (" ".join(line.split()) for line in text.splitlines())
    return page_title(html), "\n".join(line for line in lines if line)
