"""The broker layer: every name on the wire and every JetStream mechanism the agents share.

Of the package it imports only ``schemas`` (never the agents, never torch), so the SDK and
operator tools can use it. See docs/ARCHITECTURE.md, "Layout and import root".
"""
