"""Who may talk to the coordinator: certificates (certs.py) and the transport and per-RPC checks
(transport.py)."""
