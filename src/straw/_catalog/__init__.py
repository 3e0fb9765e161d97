"""The pool-wide ownership catalog: who needs which pack, and what may be reclaimed.

``state`` is the pure model (events in, decisions out); ``log`` keeps it in a
checksummed, chained log shared by every client under one ``flock``
(docs/GC.md, docs/DURABILITY.md G1-G5).
"""
