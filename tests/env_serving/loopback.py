"""Loopback HTTP servers on a background thread, for the env-server and remote-env tests (a
helper module, not a test file)."""

import threading


def serve_in_background(server) -> str:
    """Serves `server` on 127.0.0.1 from a daemon thread; returns its URL. `server` is an
    `rl_tpu.env_serving.server.EnvServer` (uvicorn) or a stdlib `http.server.HTTPServer` (the tests'
    misbehaving fake servers). `stop(server)` ends it."""
    if hasattr(server, "start"):
        return server.start()
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return "http://{}:{}".format(*server.server_address[:2])


def stop(server) -> None:
    server.shutdown()
    if hasattr(server, "server_close"):
        server.server_close()
