"""The record every curation step sees: one document, its text and what is known of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Document:
    id: str
    text: str
    # The source's fields (url, title, date...) and what the steps learn (language, scores).
    meta: dict[str, Any] = field(default_factory=dict)

    def record(self, text_key: str = "text") -> dict[str, Any]:
        """The JSON line written for it: the text under `text_key`, the id, then the meta."""
        return {text_key: self.text, "id": self.id, **self.meta}

    @classmethod
    def from_record(cls, record: dict[str, Any], text_key: str = "text") -> Document:
        meta = {k: v for k, v in record.items() if k not in (text_key, "id")}
        return cls(str(record["id"]), str(record[text_key]), meta)
