"""OpenAI Chat Completions."""
