"""exspec HTTP server: OpenAI protocol models, app factory, streaming, metrics, CLI entry."""
