"""Pack files: pure framing (``frame``), the appending writer and the verifying reader.

docs/FORMAT.md is the normative description of the bytes produced here.
"""
