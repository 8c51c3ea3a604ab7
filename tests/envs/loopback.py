"""Loopback HTTP servers on a background thread, for the env-server and remote-env tests (a
helper module, not a test file)."""

import threading


def serve_in_background(server) -> str:
    """Serves `server` (an http.server.HTTPServer bound to 127.0.0.1) on daemon threads;
    returns its URL. `stop(server)` ends it."""
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return "http://{}:{}".format(*server.server_address[:2])


def stop(server) -> None:
    server.shutdown()
    server.server_close()
