"""The OpenAI-compatible server: protocol (validation), serving (requests -> responses), api_server (app)."""
