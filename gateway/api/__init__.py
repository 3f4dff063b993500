"""The HTTP surfaces: OpenAI, Workers-style, the catalog and the admin API, and how a request body is read."""
