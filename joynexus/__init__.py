"""JoyNexus: a multi-tenant post-training service for VLA policies on NATS JetStream."""

__version__ = "0.1.0"
