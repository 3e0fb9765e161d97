"""The only package that makes bytes durable or visible (STYLE.md habit 7).

Every fsync, fdatasync, rename, link and advisory lock of straw lives here, so
the ordering rules of docs/DURABILITY.md are written in one place.
"""
