"""The wire dialects: each translates its request body into a NormalizedRequest and
encodes the backend's events back into its own JSON bodies and SSE frames."""
