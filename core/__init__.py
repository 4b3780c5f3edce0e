"""The bottom layer every package may import: the config base and network helpers."""
