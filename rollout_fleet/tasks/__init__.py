"""Synthetic verifiable tasks whose datasets come out in verl's Parquet layout."""
