"""fairlane: a fair, multi-tenant LLM inference fleet over NATS JetStream."""

__version__ = "0.1.0"
