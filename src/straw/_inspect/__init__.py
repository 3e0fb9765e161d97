"""Read-only inspection and checking of a pool (``straw inspect``, ``straw check``; docs/CHECK.md).

Layer L7: it reads what the lower layers write (packs, the catalog, queue
journals) with their own decoders and never holds a lock a live process needs
for longer than one read or one repair.
"""
