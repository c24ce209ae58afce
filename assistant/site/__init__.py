"""`assistant kb site`: the knowledge base as a static website (no server, no network).

build.py writes the pages and the search index; pages.py renders HTML with every
KB text escaped; assets/ holds the stylesheet and the vanilla-JS search.
"""
