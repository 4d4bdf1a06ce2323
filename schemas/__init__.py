"""Every message on the wire and every config, as msgspec Structs: the bottom layer.

Decoding is lenient in production (unknown fields are ignored, so a newer
peer can add fields) and strict where ``JOYNEXUS_STRICT_DECODE=1`` is set
(the test suite), so a typo in a field name fails a test instead of being
dropped silently. See docs/ARCHITECTURE.md, "Layout and import root".
"""
