"""A loopback TCP proxy that breaks HTTP responses on demand, in front of the moto S3 server.

`FaultProxy(upstream_port)` listens on 127.0.0.1:<free port> and relays every connection to
the upstream server, watching each request line (HTTP/1.1 keep-alive included: the clients
here never pipeline, so a request starts a read of its own). `proxy.fault = ...` decides what
happens to the response of each request from then on:

- "pass": relayed as is;
- "cut": the response's headers and `body_bytes` bytes of its body are relayed, then both
  sockets are closed (a connection cut mid-body: aiohttp's ClientPayloadError);
- "stall": the same, then nothing more until the fault changes or the proxy stops (the
  client's read timeout decides);
- "5xx": the request is answered `503 Service Unavailable` by the proxy itself.

`proxy.set_fault(fault, times=k)` applies it to the next k requests only, then passes again (a
flaky link the client's retries should ride out); `only=b"model.safetensors"` limits it to
requests whose request line contains that text (the marker is read, the weights are cut).
Switching the fault closes the open connections, so a pooled one cannot dodge it. `counts`
says how many requests met each fault. Real sockets and real HTTP clients
(s3fs/aiobotocore/aiohttp): nothing is patched in-process.
"""
from __future__ import annotations

import collections
import contextlib
import socket
import threading

FAULTS = ("pass", "cut", "stall", "5xx")
_METHODS = (b"GET", b"HEAD", b"PUT", b"POST", b"DELETE")
_503_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
             b"<Message>fault proxy</Message></Error>")
_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_503_BODY), _503_BODY))


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", body_bytes: int = 16):
        self.upstream = (upstream_host, upstream_port)
        self.body_bytes = body_bytes
        self._fault = "pass"
        self._times: int | None = None  # requests left for the fault; None: until changed
        self._only: bytes | None = None
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._changed = threading.Event()  # wakes stalled connections
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def fault(self) -> str:
        return self._fault

    @fault.setter
    def fault(self, value: str) -> None:
        self.set_fault(value)

    def set_fault(self, value: str, times: int | None = None, only: bytes | None = None) -> None:
        if value not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, not {value!r}")
        with self._lock:
            self._fault, self._times, self._only = value, times, only
            old, self._open = self._open, set()
            self._changed.set()
            self._changed = threading.Event()
        for s in old:
            _close(s)

    def stop(self) -> None:
        self._stopped.set()
        self.fault = "pass"  # releases stalled connections and closes the open ones
        _close(self._listener)
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ relaying

    def _arm(self, request_line: bytes) -> tuple[str, threading.Event]:
        """The fault for the response to this request (counted), and the event that ends a stall."""
        with self._lock:
            fault = self._fault
            if fault != "pass" and self._only is not None and self._only not in request_line:
                fault = "pass"
            elif fault != "pass" and self._times is not None:
                self._times -= 1
                if self._times <= 0:
                    self._fault, self._times = "pass", None
            self.counts[fault] += 1
            return fault, self._changed

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        armed: list[tuple[str, threading.Event]] = [("pass", threading.Event())]  # the response in flight
        try:
            upstream = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._open.add(upstream)

        def requests() -> None:
            try:
                while chunk := client.recv(65536):
                    if chunk.split(b" ", 1)[0] in _METHODS:  # a new request (never pipelined here)
                        armed[0] = self._arm(chunk.split(b"\r\n", 1)[0])
                        if armed[0][0] == "5xx":
                            client.sendall(_503)
                            return
                    upstream.sendall(chunk)
            except OSError:
                pass
            finally:
                _close(client)
                _close(upstream)

        threading.Thread(target=requests, daemon=True).start()
        try:
            while chunk := upstream.recv(65536):
                fault, changed = armed[0]
                if fault == "pass":
                    client.sendall(chunk)
                    continue
                while b"\r\n\r\n" not in chunk and (more := upstream.recv(65536)):
                    chunk += more
                end = chunk.find(b"\r\n\r\n") + 4
                client.sendall(chunk[:end + self.body_bytes])
                if fault == "stall":
                    changed.wait()
                return
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
