"""The engines: replicas, the one HTTP hop, routing, each replica's load and capacity, the fair queue."""
