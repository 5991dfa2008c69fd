"""The OpenAI-compatible HTTP front end: request schemas and the field table, chat planning,
response bodies, the Responses API and its store, /v1/tokenize; ``app.build_app`` puts them together."""
