"""Offline tool backends: aiohttp servers that speak the APIs of the real services over local data.

- :mod:`~afm_core.tools.servers.wiki`: ``POST /retrieve`` (AFM/Search-R1 wiki RAG API), BM25 over a corpus.
- :mod:`~afm_core.tools.servers.web_search`: ``POST /search`` (Serper API), BM25 over a corpus.
- :mod:`~afm_core.tools.servers.pages`: static HTML pages (a local "web") for crawling.
- :mod:`~afm_core.tools.servers.crawl`: ``POST /crawl_page``: fetch, extract, optionally summarise.

Each runs as ``python -m afm_core.tools.servers.<name> --host 127.0.0.1 --port N ...`` and answers ``GET /health``.
"""
