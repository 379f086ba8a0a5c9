"""Generation at the gateway: OpenAI completions and chat and OIP generate, streamed."""
