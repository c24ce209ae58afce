"""The chat's headless side: conversations, their history on disk, and
exports. No Textual here; assistant/tui/ draws them."""
