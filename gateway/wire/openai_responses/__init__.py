"""OpenAI Responses, with its response store."""
