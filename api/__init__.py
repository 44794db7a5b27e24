"""The completions API: OpenAI's shape over HTTP, jobs and results over Redis."""
