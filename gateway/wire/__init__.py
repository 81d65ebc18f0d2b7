"""The wire protocols: one package per foreign API, each cut the same way (``parse``: a body
into the internal chat request; ``routes``: the handlers; ``encoder``/``objects``: the
finished turn in that API's shape), and SpecGate's own HTTP, WebSocket and OpenAPI routes."""
