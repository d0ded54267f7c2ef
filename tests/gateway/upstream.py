#!/usr/bin/env python3
"""A second upstream for the gateway's tests, in Python's standard library
alone (docs/gateway.md, "Tests"): answers with chosen statuses, headers and
bodies (chunked, binary, large), echoes what it was sent, counts the
executions of POST /charges per Idempotency-Key, and can lose its answer
after acting on a request.

    upstream.py PORT_FILE     listens on 127.0.0.1, a port of the kernel's,
                              written to PORT_FILE once it is listening

Routes:
    POST /charges        201 {"charge": N, "key": K}; N counts executions
                         of K. Answers Set-Cookie and X-Trace too. With
                         ?honour=1 a key seen before answers its first
                         answer again (an upstream that dedupes keys).
                         With ?lose=1 it counts, then closes the connection
                         without an answer (for the first execution of a
                         key only when ?honour=1 too).
                         With ?fail=503 it answers that status, executing
                         nothing. With ?sleep=MS it answers MS after
                         acting. With ?latin1=1 its Location and X-Trace
                         end in the byte 0xE9 (not UTF-8).
    GET  /executions?key=K  {"executions": N}
    ANY  /echo...        200 {"method","target","headers":[[n,v]...],"body"}
    GET  /chunked        200, Transfer-Encoding: chunked, in five chunks
    GET  /binary         200, application/octet-stream, bytes 0..255 twice
    GET  /big?n=N        200, N bytes of 'x'
    GET  /status/N       N with X-Custom: yes and a small body
    GET  /slow?ms=N      200 after N ms
"""
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

lock = threading.Lock()
executions = {}  # key -> count
first_answers = {}  # key -> body of its first execution


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def send(self, status, body, ctype="application/json", headers=()):
        if status in (204, 304):
            body = b""  # no body, by RFC 9110
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def route(self):
        url = urlsplit(self.path)
        q = parse_qs(url.query)
        data = self.body()
        if url.path == "/charges" and self.command == "POST":
            key = self.headers.get("Idempotency-Key", "")
            if "fail" in q:
                return self.send(int(q["fail"][0]), b'{"error":"unavailable"}')
            honour = "honour" in q
            with lock:
                seen = key in first_answers
                if honour and seen:
                    return self.send(201, first_answers[key])
                executions[key] = executions.get(key, 0) + 1
                n = executions[key]
                body = json.dumps({"charge": n, "key": key}).encode()
                first_answers.setdefault(key, body)
            if "sleep" in q:  # acted on it; answers late
                time.sleep(int(q["sleep"][0]) / 1000)
            if "lose" in q:
                # Acted on it, then gone before answering.
                self.close_connection = True
                self.connection.shutdown(2)
                return None
            # ?latin1=1: Location and X-Trace not UTF-8 (http.server writes
            # header values as latin-1 bytes).
            tail = "-caf\u00e9" if "latin1" in q else ""
            return self.send(201, body, headers=[("Set-Cookie", "sid=1"),
                                                 ("X-Trace", "t-%d%s" % (n, tail)),
                                                 ("Location", "/charges/%d%s" % (n, tail))])
        if url.path == "/executions":
            with lock:
                n = executions.get(q.get("key", [""])[0], 0)
            return self.send(200, json.dumps({"executions": n}).encode())
        if url.path.startswith("/echo"):
            doc = {"method": self.command, "target": self.path,
                   "headers": [[k, v] for k, v in self.headers.items()],
                   "body": data.decode("latin-1")}
            return self.send(200, json.dumps(doc).encode())
        if url.path == "/chunked":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                chunk = ("chunk %d;" % i).encode() * (i + 1)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
            return None
        if url.path == "/binary":
            return self.send(200, bytes(range(256)) * 2, "application/octet-stream")
        if url.path == "/big":
            return self.send(200, b"x" * int(q["n"][0]), "text/plain")
        if url.path.startswith("/status/"):
            return self.send(int(url.path[8:]), b'{"status":"as asked"}',
                             headers=[("X-Custom", "yes")])
        if url.path == "/drip":
            # Its first bytes, then ?ms=MS of silence, then the rest.
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, part in enumerate((b"first;", b"second;")):
                if i:
                    time.sleep(int(q["ms"][0]) / 1000)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return None
        if url.path == "/slow":
            time.sleep(int(q["ms"][0]) / 1000)
            return self.send(200, b'{"slow":true}')
        return self.send(404, b'{"error":"not found"}')

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = route


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    import os
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
