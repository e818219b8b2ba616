"""Running the app under uvicorn: in the foreground (the CLI) or in a background thread (tests,
benchmarks, notebooks).

On SIGINT/SIGTERM uvicorn stops accepting connections and waits for open ones to end; `Server`
also drains the engine at that moment: queued requests are answered 503 at once, running ones get
`grace_s` seconds to finish and are then cancelled (503, in the stream when it has started), so
shutdown never waits on a long generation. A second signal exits at once (uvicorn's force exit).
"""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class Server(uvicorn.Server):
    """uvicorn.Server whose exit also drains the app's engine (see the module docstring)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 8080, grace_s: float = 5.0,
                 log_level: str = "info", access_log: bool = False):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        access_log=access_log, lifespan="on",
                                        timeout_graceful_shutdown=grace_s + 10.0))
        self.app = app
        self.grace_s = grace_s
        app.state.pij.stop_server = self.stop

    def handle_exit(self, sig: int, frame) -> None:
        self.app.state.pij.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """Exit as on SIGTERM, from any thread (without recording a signal, which uvicorn would
        re-raise once it has exited)."""
        self.app.state.pij.begin_shutdown(self.grace_s)
        self.should_exit = True


class ServerThread:
    """The app served on `host` (a free port unless one is given) by a background thread.

        with ServerThread(create_app(session, slots=4)) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="none")...
    """

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0,
                 log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = Server(app, host=self.host, port=self.port, grace_s=grace_s,
                             log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="pij-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        """Start serving; returns once the socket accepts connections (the model may still be
        loading: GET /health says when it is ready)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Shut down as on SIGTERM; True when the thread exited within `timeout`."""
        self.server.stop()
        self.thread.join(timeout)
        self.sock.close()
        return not self.thread.is_alive()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
