"""Running an app under uvicorn: in the foreground (``specdec serve``) or in a background
thread on a free loopback port (tests, notebooks, the load script)."""
from __future__ import annotations

import socket
import threading
import time


def _server(app, **config):
    """A uvicorn server for ``app`` that, on its exit signal (SIGINT, SIGTERM, ``should_exit``
    from ``BackgroundServer.stop``), first closes the app's scheduler: new requests get 503 and
    running ones end at once with finish reason ``abort``, so that the grace period finds no
    handler to cancel."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            close(app)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **config))


def close(app) -> None:
    scheduler = getattr(getattr(app, "state", None), "scheduler", None)
    if scheduler is not None:
        scheduler.close()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one), as uvicorn binds it;
    ``ValueError`` when it cannot be (a port in use, an unknown host). ``specdec serve`` binds
    before loading its models, as vLLM does, so that such a mistake shows at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          sock: socket.socket | None = None) -> None:
    """Serve ``app`` on ``sock`` (bound by ``listen_socket``) or else on ``host:port``."""
    if sock is None:
        sock = listen_socket(host, port)
    _server(app, log_level=log_level).run(sockets=[sock])


class BackgroundServer:
    """``with BackgroundServer(app) as srv: ... srv.url ...`` serves ``app`` until the block ends."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = listen_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = app
        self.server = _server(app, log_level=log_level, lifespan="on")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specdec-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        close(self.app)
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
