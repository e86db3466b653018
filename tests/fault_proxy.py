"""A loopback TCP proxy that breaks HTTP responses on demand, in front of the moto S3 server.

`FaultProxy(upstream_port)` listens on 127.0.0.1:<free port> and relays every connection to
the upstream server. `proxy.fault = ...` decides what happens to connections opened from then
on (switching also closes the open ones, so a pooled keep-alive connection cannot dodge it):

- "pass": relayed as is;
- "cut": the response's headers and `body_bytes` bytes of its body are relayed, then both
  sockets are closed (a connection cut mid-body: aiohttp's ClientPayloadError);
- "stall": the same, then nothing more until the fault changes or the proxy stops (the
  client's read timeout decides);
- "5xx": the request is read and answered `503 Service Unavailable` by the proxy itself.

Real sockets, real HTTP clients (s3fs/aiobotocore/aiohttp): nothing is patched in-process.
`proxy.set_fault(fault, times=k)` applies it to the next k connections only, then passes again
(a flaky link the client's retries should ride out). `counts` says how many connections met
each fault.
"""
from __future__ import annotations

import collections
import contextlib
import socket
import threading

FAULTS = ("pass", "cut", "stall", "5xx")
_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 118\r\n"
        b"Connection: close\r\n\r\n<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ServiceUnavailable</Code>"
        b"<Message>fault proxy</Message></Error>")


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", body_bytes: int = 16):
        self.upstream = (upstream_host, upstream_port)
        self.body_bytes = body_bytes
        self._fault = "pass"
        self._times: int | None = None  # connections left for the fault, None: until changed
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

    def set_fault(self, value: str, times: int | None = None) -> None:
        if value not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, not {value!r}")
        with self._lock:
            self._fault, self._times = value, times
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

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ relaying

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                fault, changed = self._fault, self._changed
                if self._times is not None:
                    self._times -= 1
                    if self._times <= 0:
                        self._fault, self._times = "pass", None
                self._open.add(client)
            self.counts[fault] += 1
            threading.Thread(target=self._serve, args=(client, fault, changed), daemon=True).start()

    def _serve(self, client: socket.socket, fault: str, changed: threading.Event) -> None:
        try:
            if fault == "5xx":
                _read_headers(client)
                client.sendall(_503)
                return
            upstream = socket.create_connection(self.upstream, timeout=30)
            with self._lock:
                self._open.add(upstream)
            threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
            if fault == "pass":
                _pipe(upstream, client)
                return
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = upstream.recv(65536)
                if not chunk:
                    return
                head += chunk
            end = head.index(b"\r\n\r\n") + 4
            client.sendall(head[:end + self.body_bytes])
            if fault == "stall":
                changed.wait()
        except OSError:
            pass
        finally:
            _close(client)
            with self._lock:
                self._open.discard(client)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        _close(dst)
        _close(src)


def _read_headers(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
