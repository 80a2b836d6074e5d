"""The public edge: websocket proxy and OpenAI-compatible HTTP API (DESIGN.md section 7)."""
