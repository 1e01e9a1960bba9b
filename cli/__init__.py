"""The `diloco` command line: it parses and calls the library."""

import os

# gRPC core logs each failed TLS handshake ("I1206 ... Handshake failed") to stderr, into
# `diloco status` and every role's output; the CLI says what failed itself. Set here, before any
# command module imports grpc, which is when gRPC reads it; the user's value wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
