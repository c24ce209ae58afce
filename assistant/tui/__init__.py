"""The Textual chat (`assistant` / `assistant chat`): a thin layer over the headless core."""
