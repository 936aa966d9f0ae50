"""The per-process runtime: links and credit, pending calls, routing and relays, peer
liveness, dispatch into mailboxes; :mod:`._runtime` wires the parts together."""
