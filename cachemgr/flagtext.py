"""The word-list text of a generated flag table (cachemgr/sglang/flags.py, cachemgr/vllm/flags.py):
`field: value value …` entries, wrapped freely, read back as a dict."""

from __future__ import annotations


def by_field(text: str) -> dict[str, tuple[str, ...]]:
    """`field: value value …` entries (wrapped freely) as a dict of tuples."""
    out: dict[str, list[str]] = {}
    for word in text.split():
        if word.endswith(":"):
            field = out.setdefault(word[:-1], [])
        else:
            field.append(word)
    return {name: tuple(values) for name, values in out.items()}
