"""The process: the app factory and its lifespan, the edge, serving one or many processes, readiness, OpenAPI."""
