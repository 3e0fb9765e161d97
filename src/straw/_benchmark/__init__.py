"""Machinery of ``straw.benchmark``: trace profiles and the local queue benchmark (``straw-benchmark``)."""
