"""Real Responses-API clients (the Codex CLI, openai-agents) driven against real upstreams."""
