"""An OTLP/HTTP trace receiver (tests, bench/tracing_cost.py): decodes each POST to /v1/traces
(protobuf ExportTraceServiceRequest, as opentelemetry-proto defines it) into span rows, as a
collector's OTLP/HTTP receiver would take them.

    python -m bench.otlp_sink --port 4318 --out spans.json     # until SIGTERM; then the rows as JSON
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int = 0
    end_ns: int = 0


class OTLPReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.take(self.path, self.headers.get("Content-Type", ""), body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(b"")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def take(self, path: str, content_type: str, body: bytes) -> None:
        assert path == "/v1/traces" and content_type == "application/x-protobuf", (path, content_type)
        request = ExportTraceServiceRequest.FromString(body)
        rows = []
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                rows += [ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                      s.start_time_unix_nano, s.end_time_unix_nano) for s in ss.spans]
        with self._lock:
            self.spans += rows
            self.posts += 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.otlp_sink", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True, help="where the rows go (JSON) once it is stopped (SIGTERM)")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before it listens: a caller that saw it listen may stop it
    receiver = OTLPReceiver(args.host, args.port)
    while not stop.wait(0.2):  # timed: a set() from the handler between the flag's check and the wait is seen
        pass
    receiver.close()
    with open(args.out, "w") as f:
        json.dump({"posts": receiver.posts, "spans": [asdict(s) for s in receiver.spans]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
