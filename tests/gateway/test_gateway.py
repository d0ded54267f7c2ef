#!/usr/bin/env python3
"""`idemd gateway` against applications idem did not write in C
(docs/gateway.md, "Tests"): the naive PHP orders application
(examples/gateway/orders.php, under `php -S`) and a Python one (upstream.py).

Run by ctest as gateway_apps (SQLite) and gateway_apps_pg (through
scripts/with-pg.sh, IDEM_TEST_STORE_URL naming the cluster). Needs
IDEM_TEST_IDEMD (the idemd binary), php with its sqlite3 module, python3.
Every server listens on 127.0.0.1; every wait is a bounded loop.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
ORDERS_PHP = os.path.join(HERE, "..", "..", "examples", "gateway", "orders.php")
IDEMD = os.environ["IDEM_TEST_IDEMD"]
STORE_URL = os.environ.get("IDEM_TEST_STORE_URL") or ""
TMP = tempfile.mkdtemp(prefix="idem-gw-test.")
procs = []


def start(args, env=None, log=None):
    out = open(log, "wb") if log else subprocess.DEVNULL
    p = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT if log else out,
                         start_new_session=True)
    procs.append(p)
    return p


def stop(p, sig=signal.SIGTERM):
    try:
        os.killpg(p.pid, sig)  # the process group this test started
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, what, tries=200):
    for _ in range(tries):
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def req(port, method, target, headers=None, body=None, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, target, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.getheaders(), r.read()
    finally:
        c.close()


def header(headers, name):
    vals = [v for k, v in headers if k.lower() == name.lower()]
    return vals[0] if vals else None


def answers(port):
    def ok():
        try:
            req(port, "GET", "/count", timeout=2)
            return True
        except OSError:
            return False
    return ok


def start_php(work_ms=3000, port=None, workers=40, die_marker=None):
    port = port or free_port()
    env = dict(os.environ, ORDERS_DB=os.path.join(TMP, "orders-%d.db" % port),
               ORDERS_WORK_MS=str(work_ms))
    if workers:
        env["PHP_CLI_SERVER_WORKERS"] = str(workers)
    if die_marker:
        env["ORDERS_DIE_MARKER"] = die_marker
    p = start(["php", "-S", "127.0.0.1:%d" % port, ORDERS_PHP],
              env=env)
    wait_until(answers(port), "php -S")
    return port if not die_marker else (port, p)


def start_python_upstream():
    port_file = os.path.join(TMP, "py-%s.port" % uuid.uuid4().hex)
    start([sys.executable, os.path.join(HERE, "upstream.py"), port_file])
    wait_until(lambda: os.path.exists(port_file), "upstream.py")
    with open(port_file) as f:
        return int(f.read())


def fresh_db():
    """A database of its own: a SQLite file, or one made on the cluster
    IDEM_TEST_STORE_URL names (gateways on one database share their
    unsettled keys, as they should when they front one application)."""
    name = "gw_" + uuid.uuid4().hex[:12]
    if not STORE_URL:
        return os.path.join(TMP, name + ".db")
    subprocess.run(["psql", "-q", STORE_URL, "-c", "CREATE DATABASE " + name], check=True,
                   stdout=subprocess.DEVNULL)
    u = urlsplit(STORE_URL)
    return "%s://%s/%s%s" % (u.scheme, u.netloc, name, "?" + u.query if u.query else "")


def start_gateway(upstream_port, routes, *flags, db=None, upstream=None):
    log = os.path.join(TMP, "gw-%s.log" % uuid.uuid4().hex)
    args = [IDEMD, "gateway", "--upstream",
            upstream or "http://127.0.0.1:%d" % upstream_port,
            "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
            "--db", db or fresh_db()]
    for r in routes:
        args += ["--route", r]
    p = start(args + list(flags), log=log)
    ports = {}

    def started():
        with open(log) as f:
            m = re.search(r'"listen_port":"(\d+)","admin_port":"(\d+)"', f.read())
        if m:
            ports["listen"], ports["admin"] = int(m.group(1)), int(m.group(2))
        assert p.poll() is None, "the gateway exited: " + open(log).read()
        return bool(m)
    wait_until(started, "the gateway to start")
    gateway_logs[p.pid] = log
    return p, ports["listen"], ports["admin"], log


gateway_logs = {}


def stop_gateway(p):
    """SIGTERM: the gateway exits 0 (under ASan, also with no leak)."""
    stop(p)
    assert p.returncode == 0, "the gateway exited %s: %s" % (
        p.returncode, open(gateway_logs[p.pid]).read()[-3000:])


def php_count(port):
    return json.loads(req(port, "GET", "/count")[2])["orders"]


def executions(port, key):
    return json.loads(req(port, "GET", "/executions?key=" + key)[2])["executions"]


def order(key, item="book", quantity=2, spaced=False):
    body = ('{ "quantity" : %d, "item" : "%s" }' % (quantity, item) if spaced
            else json.dumps({"item": item, "quantity": quantity}))
    h = {"Content-Type": "application/json"}
    if key is not None:
        h["Idempotency-Key"] = key
    return h, body


def together(n, fn):
    barrier = threading.Barrier(n)
    results = [None] * n

    def run(i):
        barrier.wait()
        results[i] = fn()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


KEYS_SEEN = []


def new_key():
    k = uuid.uuid4().hex
    KEYS_SEEN.append(k)
    return k


# ---- the tests ----

def test_naive_app_duplicates_alone(php):
    """The premise: without the gateway, 20 requests with one key at once
    make duplicates in the naive application: each that looked the key up
    before the first inserted makes a row of its own (20 when php -S hands
    each to a worker of its own; a worker that took two connections serves
    the second after the first, which then finds the row)."""
    before = php_count(php)
    key = new_key()
    res = together(20, lambda: req(php, "POST", "/orders", *order(key)))
    made = php_count(php) - before
    assert made == sum(s == 201 for s, _, _ in res), made
    assert made > 1, "the naive app made one row: the premise does not hold"
    print("     without the gateway: %d rows from 20 requests with one key" % made)


def test_twenty_at_once_make_one(php, gw):
    before = php_count(php)
    key = new_key()
    res = together(20, lambda: req(gw, "POST", "/orders", *order(key)))
    assert php_count(php) - before == 1, php_count(php) - before
    statuses = {s for s, _, _ in res}
    bodies = {b for _, _, b in res}
    assert statuses == {201}, statuses
    assert len(bodies) == 1, bodies
    replayed = [header(h, "Idempotent-Replayed") for _, h, _ in res]
    assert replayed.count("true") == 19, replayed
    locations = {header(h, "Location") for _, h, _ in res}
    assert len(locations) == 1 and None not in locations, locations
    # Set-Cookie went to the first client only; never replayed.
    cookies = [header(h, "Set-Cookie") for _, h, _ in res]
    assert sum(c is not None for c in cookies) == 1, cookies


def test_same_request_spelled_otherwise_replays(php, gw):
    key = new_key()
    s1, h1, b1 = req(gw, "POST", "/orders", *order(key))
    s2, h2, b2 = req(gw, "POST", "/orders", *order(key, spaced=True))
    assert (s1, s2) == (201, 201) and b1 == b2, (s1, s2, b1, b2)
    assert header(h1, "Idempotent-Replayed") is None
    assert header(h2, "Idempotent-Replayed") == "true"
    assert header(h2, "Content-Type") == "application/json"


def test_different_body_is_422(php, gw):
    key = new_key()
    assert req(gw, "POST", "/orders", *order(key))[0] == 201
    before = php_count(php)
    for h, body in (order(key, quantity=3), order(key, item="pen")):
        s, _, b = req(gw, "POST", "/orders", h, body)
        assert s == 422, (s, b)
        assert json.loads(b) == {
            "error": "Idempotency-Key was already used with a different request"}, b
    # Another query under the key is another request too.
    s, _, b = req(gw, "POST", "/orders?x=1", *order(key))
    assert s == 422, (s, b)
    assert php_count(php) == before


def test_replays_from_memory(py, gw_py, admin_py):
    """A replayed key is kept ready in memory: its next replays are the
    same bytes and headers (Set-Cookie never), another request under it is
    422 from there too, and nothing is sent again."""
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s0, h0, b0 = req(gw_py, "POST", "/charges", h, "{}")
    hits = metric(admin_py, "idem_replay_cache_hits_total")
    seen = [req(gw_py, "POST", "/charges", h, "{}") for _ in range(3)]
    assert metric(admin_py, "idem_replay_cache_hits_total") >= hits + 2
    for s, hs, b in seen:
        assert (s, b) == (s0, b0) and header(hs, "Idempotent-Replayed") == "true", (s, b)
        assert header(hs, "Location") == header(h0, "Location")
        assert header(hs, "Set-Cookie") is None
    s, _, b = req(gw_py, "POST", "/charges", h, '{"other": 1}')
    assert s == 422, (s, b)
    assert metric(admin_py, "idem_replay_cache_hits_total") >= hits + 3
    assert executions(py, key) == 1


def test_bad_keys_never_reach_the_upstream(php, gw):
    before = php_count(php)
    bad = [None, "", "   ", "a" * 256, "caf\u00e9", "tab\there", '"unterminated']
    for key in bad:
        h, body = order(None)
        if key is not None:
            h["Idempotency-Key"] = key.encode("utf-8").decode("latin-1")
        s, _, b = req(gw, "POST", "/orders", h, body)
        doc = json.loads(b)
        assert s == 400 and list(doc) == ["error"], (key, s, b)
    # Twice in one request.
    c = http.client.HTTPConnection("127.0.0.1", gw, timeout=10)
    c.putrequest("POST", "/orders")
    c.putheader("Content-Type", "application/json")
    c.putheader("Idempotency-Key", "one")
    c.putheader("Idempotency-Key", "two")
    body = order(None)[1].encode()
    c.putheader("Content-Length", str(len(body)))
    c.endheaders(body)
    r = c.getresponse()
    assert r.status == 400, r.status
    r.read()
    c.close()
    assert php_count(php) == before, "a bad key reached the application"


def test_scope_header_separates_keys(py, gw_py):
    key = new_key()
    for auth in ("Bearer alice", "Bearer bob", "Bearer alice"):
        s, _, _ = req(gw_py, "POST", "/charges", {"Idempotency-Key": key,
                                                  "Authorization": auth,
                                                  "Content-Type": "application/json"}, "{}")
        assert s == 201, s
    assert executions(py, key) == 2, executions(py, key)


def test_replay_headers(py, gw_py):
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s1, h1, b1 = req(gw_py, "POST", "/charges", h, '{"amount": 5}')
    s2, h2, b2 = req(gw_py, "POST", "/charges", h, '{"amount":5}')
    assert (s1, s2) == (201, 201) and b1 == b2
    assert header(h1, "Set-Cookie") == "sid=1" and header(h2, "Set-Cookie") is None
    assert header(h2, "X-Trace") == header(h1, "X-Trace") == "t-1"
    assert header(h2, "Location") == header(h1, "Location")
    assert header(h2, "Idempotent-Replayed") == "true"
    assert executions(py, key) == 1, "executed %d times" % executions(py, key)


def test_pass_through_byte_for_byte(py, gw_py):
    for target in ("/chunked", "/binary", "/big?n=70000", "/status/418", "/status/500",
                   "/status/204", "/nothing-here"):
        direct = req(py, "GET", target)
        through = req(gw_py, "GET", target)
        assert through[0] == direct[0], (target, through[0], direct[0])
        assert through[2] == direct[2], (target, len(through[2]), len(direct[2]))
        skip = {"date", "content-length", "transfer-encoding", "connection"}
        dh = sorted((k.lower(), v) for k, v in direct[1] if k.lower() not in skip)
        th = sorted((k.lower(), v) for k, v in through[1] if k.lower() not in skip)
        assert dh == th, (target, dh, th)
    # HEAD: no body, and the application's Content-Length.
    for target in ("/binary", "/big?n=70000"):
        direct = req(py, "HEAD", target)
        through = req(gw_py, "HEAD", target)
        assert through[0] == direct[0] == 200 and through[2] == b"", (target, through)
        assert header(through[1], "Content-Length") == header(direct[1], "Content-Length"), \
            (target, through[1], direct[1])
        assert [k.lower() for k, _ in through[1]].count("content-length") == 1, through[1]
    # The request: method, target, headers (hop-by-hop ones dropped) and body.
    body = bytes(range(1, 256)) * 3
    h = {"Content-Type": "application/octet-stream", "X-One": "1",
         "Connection": "keep-alive, X-Hop", "X-Hop": "dropped", "Keep-Alive": "timeout=5",
         "Authorization": "Bearer x"}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        s, _, b = req(gw_py, method, "/echo/a%20b?q=1&q=2", h, body)
        doc = json.loads(b)
        assert s == 200 and doc["method"] == method, (s, doc)
        assert doc["target"] == "/echo/a%20b?q=1&q=2", doc["target"]
        assert doc["body"].encode("latin-1") == body
        names = {k.lower(): v for k, v in doc["headers"]}
        assert names.get("x-one") == "1" and names.get("authorization") == "Bearer x"
        for hop in ("connection", "x-hop", "keep-alive", "te", "upgrade"):
            assert hop not in names, (hop, names)
        assert names.get("x-forwarded-for") == "127.0.0.1", names
        assert names.get("forwarded") == "for=127.0.0.1;proto=http", names
    s, _, b = req(gw_py, "GET", "/echo", {"X-Forwarded-For": "10.0.0.1"})
    names = [(k.lower(), v) for k, v in json.loads(b)["headers"]]
    # Appended to the client's, one line (two would be read as one by some,
    # the first only by others).
    assert [v for k, v in names if k == "x-forwarded-for"] == ["10.0.0.1, 127.0.0.1"], names


def hwm_kib(p):
    with open("/proc/%d/status" % p.pid) as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1))


def test_pass_through_streams_past_every_cap(py):
    """An answer larger than any cap passes through byte for byte, and the
    gateway's memory does not grow with it: the answer is streamed."""
    p, port, _, _ = start_gateway(py, ["POST /charges"], "--max-answer", "1000")
    req(port, "GET", "/big?n=70000")
    before = hwm_kib(p)
    n = 50 << 20
    s, hs, b = req(port, "GET", "/big?n=%d" % n, timeout=120)
    assert s == 200 and len(b) == n and b == b"x" * n, (s, len(b))
    grew = hwm_kib(p) - before
    assert grew < 24 << 10, "the gateway's peak RSS grew %d KiB" % grew
    stop_gateway(p)


def test_pass_through_first_bytes_before_the_end(py, gw_py):
    """A slow upstream's first bytes reach the client before it is done."""
    c = http.client.HTTPConnection("127.0.0.1", gw_py, timeout=10)
    t0 = time.monotonic()
    c.request("GET", "/drip?ms=1500")
    r = c.getresponse()
    first = r.read(6)
    t_first = time.monotonic() - t0
    rest = r.read()
    t_all = time.monotonic() - t0
    c.close()
    assert r.status == 200 and first + rest == b"first;second;", (r.status, first, rest)
    assert r.getheader("Transfer-Encoding") == "chunked", r.getheaders()
    assert t_first < 1.0 <= t_all, (t_first, t_all)


def test_lost_answer_is_pending(py, gw_py, admin_py):
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s, hs, b = req(gw_py, "POST", "/charges?lose=1", h, "{}")
    assert s == 202 and header(hs, "Retry-After"), (s, b)
    s, hs, b = req(gw_py, "POST", "/charges?lose=1", h, "{}")
    assert s == 202 and header(hs, "Idempotent-Replayed") == "true", (s, b)
    assert executions(py, key) == 1, "executed %d times" % executions(py, key)
    metrics = req(admin_py, "GET", "/metrics")[2].decode()
    assert re.search(r"^idem_records_pending [1-9]", metrics, re.M), metrics
    assert re.search(r"^idem_gateway_upstream_no_answer_total [1-9]", metrics, re.M)


def test_timeout_after_send_is_pending(py):
    """Sent, and no answer within --upstream-timeout (the I/O thread's
    deadline): pending, 202, never sent again; its retry replays 202."""
    p, port, admin, _ = start_gateway(py, ["POST /charges"], "--upstream-timeout", "300ms",
                                      "--lease", "2s")
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    t0 = time.monotonic()
    s, hs, b = req(port, "POST", "/charges?sleep=1500", h, "{}")
    took = time.monotonic() - t0
    assert s == 202 and header(hs, "Retry-After") == "5", (s, b)
    assert took < 1.2, "answered after %.2f s, not at the deadline" % took
    s, hs, b = req(port, "POST", "/charges?sleep=1500", h, "{}")
    assert s == 202 and header(hs, "Idempotent-Replayed") == "true", (s, b)
    time.sleep(1.5)  # the upstream's own (late) answer is over
    assert executions(py, key) == 1, "executed %d times" % executions(py, key)
    assert metric(admin, "idem_gateway_upstream_no_answer_total") == 1
    stop_gateway(p)


def test_twenty_at_once_one_execution_fast_upstream(py, gw_py):
    """As test_twenty_at_once_make_one, through the Python upstream: the
    nineteen duplicates park on the key (no thread each) and replay."""
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    res = together(20, lambda: req(gw_py, "POST", "/charges?sleep=300", h, "{}"))
    assert executions(py, key) == 1, "executed %d times" % executions(py, key)
    assert {s for s, _, _ in res} == {201}, [s for s, _, _ in res]
    assert len({b for _, _, b in res}) == 1
    replayed = [header(hs, "Idempotent-Replayed") for _, hs, _ in res]
    assert replayed.count("true") == 19, replayed


def test_duplicate_waits_no_longer_than_its_bound(py):
    """A duplicate in flight waits --inflight-wait, then 409: the parked
    request is woken at its bound while the original is at the upstream."""
    p, port, _, _ = start_gateway(py, ["POST /charges"], "--inflight-wait", "200ms")
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    first = {}
    t = threading.Thread(target=lambda: first.update(
        r=req(port, "POST", "/charges?sleep=1500", h, "{}")))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s, hs, b = req(port, "POST", "/charges?sleep=1500", h, "{}")
    took = time.monotonic() - t0
    assert s == 409 and header(hs, "Retry-After") == "1", (s, b)
    assert took < 1.0, "the duplicate waited %.2f s" % took
    t.join()
    assert first["r"][0] == 201, first["r"]
    s, hs, b = req(port, "POST", "/charges?sleep=1500", h, "{}")
    assert s == 201 and header(hs, "Idempotent-Replayed") == "true", (s, b)
    assert executions(py, key) == 1
    stop_gateway(p)


def test_too_large_answer_blocks_a_second_run(py, gw_small):
    h = {"Idempotency-Key": new_key()}
    s, _, b = req(gw_small, "GET", "/big?n=900", h)
    assert s == 200 and b == b"x" * 900, s  # within --max-answer
    h = {"Idempotency-Key": new_key()}
    s1, _, b1 = req(gw_small, "GET", "/big?n=5000", h)
    s2, h2, b2 = req(gw_small, "GET", "/big?n=5000", h)
    assert s1 == 502 and s2 == 502 and b1 == b2, (s1, s2)
    assert list(json.loads(b2)) == ["error"], b2
    assert header(h2, "Idempotent-Replayed") == "true"


def test_refused_frees_the_key(py):
    dead = free_port()
    key = new_key()
    db = fresh_db()
    p, port, _, _ = start_gateway(0, ["POST /charges"], db=db,
                                  upstream="http://127.0.0.1:%d" % dead)
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s, hs, b = req(port, "POST", "/charges", h, "{}")
    assert s == 503 and header(hs, "Retry-After") == "1", (s, b)
    stop_gateway(p)
    p, port, _, _ = start_gateway(py, ["POST /charges"], db=db)
    s, hs, b = req(port, "POST", "/charges", h, "{}")
    assert s == 201 and header(hs, "Idempotent-Replayed") is None, (s, b)
    assert executions(py, key) == 1, "executed %d times" % executions(py, key)
    stop_gateway(p)


def test_5xx_kept_unless_upstream_idempotent(py, gw_py):
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s1, _, _ = req(gw_py, "POST", "/charges?fail=503", h, "{}")
    s2, h2, _ = req(gw_py, "POST", "/charges?fail=503", h, "{}")
    assert (s1, s2) == (503, 503) and header(h2, "Idempotent-Replayed") == "true"
    p, port, _, _ = start_gateway(py, ["POST /charges"], "--upstream-idempotent")
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s1, _, _ = req(port, "POST", "/charges?fail=503", h, "{}")
    s2, h2, _ = req(port, "POST", "/charges?fail=503", h, "{}")
    assert (s1, s2) == (503, 503) and header(h2, "Idempotent-Replayed") is None
    stop_gateway(p)


def metric(admin, name):
    text = req(admin, "GET", "/metrics")[2].decode()
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def test_killed_upstream_resolves_to_one_row():
    """The PHP application killed after its INSERT and before its answer:
    the record is pending (202); with --upstream-idempotent the resolver
    sends the request again under its key once the application is back,
    and the naive application, which finds the key now, answers its row:
    one row, and every retry gets that answer."""
    marker = os.path.join(TMP, "die-once")
    open(marker, "w").close()
    port, php_p = start_php(work_ms=0, workers=0, die_marker=marker)
    db = fresh_db()
    g, gw, admin, _ = start_gateway(port, ["POST /orders"], "--upstream-idempotent",
                                    "--upstream-timeout", "2s", "--lease", "3s", db=db)
    key = new_key()
    s, hs, b = req(gw, "POST", "/orders", *order(key))
    assert s == 202 and header(hs, "Retry-After"), (s, b)
    assert not os.path.exists(marker), "the application was not killed"
    php_p.wait(timeout=10)
    # Back, on its port and database.
    start_php(work_ms=0, port=port, workers=0)
    answers_seen = []

    def settled():
        s, hs, b = req(gw, "POST", "/orders", *order(key))
        answers_seen.append(s)
        return s != 202
    wait_until(settled, "the pending record to resolve", tries=400)
    s, hs, b = req(gw, "POST", "/orders", *order(key))
    assert s == 200 and header(hs, "Idempotent-Replayed") == "true", (s, b)
    assert json.loads(b)["id"] == 1, b
    assert php_count(port) == 1, php_count(port)
    assert metric(admin, "idem_gateway_resolved_total") >= 1
    stop_gateway(g)


def test_pending_stays_without_upstream_idempotent(py):
    """Without --upstream-idempotent nothing is sent again: a lost answer
    stays pending, and metrics and `idemd gateway pending` show it."""
    db = fresh_db()
    g, gw, admin, _ = start_gateway(py, ["POST /charges"], db=db)
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    assert req(gw, "POST", "/charges?lose=1&honour=1", h, "{}")[0] == 202
    for _ in range(3):
        s, _, _ = req(gw, "POST", "/charges?lose=1&honour=1", h, "{}")
        assert s == 202, s
        time.sleep(0.6)  # over the resolver's interval; asserts nothing on time
    assert executions(py, key) == 1, executions(py, key)
    assert metric(admin, "idem_records_pending") == 1
    out = subprocess.run([IDEMD, "gateway", "pending", "--db", db], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0].split()[:3] == ["STATE", "ROUTE", "KEY"], out
    rows = [l.split() for l in out[1:]]
    assert len(rows) == 1 and rows[0][0] == "pending" and key in rows[0], out
    assert rows[0][4] == "0", out  # never sent again
    stop_gateway(g)


def test_kill9_under_load_loses_nothing_acknowledged(py):
    """kill -9 of the gateway while clients send new keys: every answer a
    client got is replayed as it was by a gateway started again on the
    database, and no key ran twice at the upstream."""
    db = fresh_db()
    g, gw, _, _ = start_gateway(py, ["POST /charges"], "--lease", "2s",
                                "--upstream-timeout", "1s", db=db)
    acked, tried = {}, []
    lock = threading.Lock()
    stop_flag = threading.Event()

    def client(n):
        i = 0
        while not stop_flag.is_set() and i < 2000:
            key = "k9-%d-%d-%s" % (n, i, uuid.uuid4().hex[:8])
            i += 1
            with lock:
                tried.append(key)
            try:
                s, hs, b = req(gw, "POST", "/charges", {
                    "Idempotency-Key": key, "Content-Type": "application/json"}, "{}",
                    timeout=5)
            except OSError:
                continue
            if 200 <= s < 300:
                with lock:
                    acked[key] = (s, b)
    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acked) >= 200, "answers under load", tries=1200)
    os.killpg(g.pid, signal.SIGKILL)
    g.wait()
    stop_flag.set()
    for t in threads:
        t.join()
    g, gw, _, _ = start_gateway(py, ["POST /charges"], "--lease", "2s",
                                "--upstream-timeout", "1s", db=db)
    for key, (s, b) in acked.items():
        s2, hs, b2 = req(gw, "POST", "/charges", {
            "Idempotency-Key": key, "Content-Type": "application/json"}, "{}")
        assert (s2, b2) == (s, b), (key, s, s2)
        assert header(hs, "Idempotent-Replayed") == "true"
    for key in tried:
        assert executions(py, key) <= 1, key
    print("     %d answers acknowledged before kill -9, all replayed" % len(acked))
    stop_gateway(g)


def test_dead_gateway_taken_over_by_lease(py):
    """kill -9 of the gateway while its request is at the application:
    once its lease has run out, another gateway on the database takes the
    key over and, with --upstream-idempotent, sends it again under its
    key; the application, which honours keys, ran it once."""
    db = fresh_db()
    flags = ("--upstream-idempotent", "--lease", "2s", "--upstream-timeout", "1s")
    a, gw_a, _, _ = start_gateway(py, ["POST /charges"], *flags, db=db)
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}

    def first():
        try:
            req(gw_a, "POST", "/charges?honour=1&sleep=800", h, "{}")
        except OSError:
            pass  # its gateway died
    t = threading.Thread(target=first)
    t.start()
    wait_until(lambda: executions(py, key) == 1, "the application to act")
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    t.join()
    b, gw_b, admin_b, _ = start_gateway(py, ["POST /charges"], *flags, db=db)
    statuses = []

    def settled():
        s, hs, body = req(gw_b, "POST", "/charges?honour=1&sleep=800", h, "{}")
        statuses.append(s)
        return s == 201
    wait_until(settled, "the key to be taken over and settled", tries=400)
    assert set(statuses) <= {409, 202, 201}, statuses  # in flight, pending, done
    s, hs, body = req(gw_b, "POST", "/charges?honour=1&sleep=800", h, "{}")
    assert s == 201 and header(hs, "Idempotent-Replayed") == "true", (s, body)
    assert json.loads(body) == {"charge": 1, "key": key}, body
    assert executions(py, key) == 1, executions(py, key)
    assert metric(admin_b, "idem_gateway_resolved_total") == 1
    stop_gateway(b)


def raw(port, data, timeout=10):
    """Sends `data` as it is and returns the status of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while b"\r\n" not in out:
            d = s.recv(4096)
            if not d:
                break
            out += d
    return int(out.split(b" ")[1]) if out.startswith(b"HTTP/1.1 ") else None


def test_smuggling_refused(py, gw_py):
    """A header line the upstream could read as two (a bare CR), folded
    over lines, a name that is no token, or Host twice: 400 before
    routing, and nothing reaches the upstream."""
    key = new_key()
    head = (b"POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: " + key.encode() +
            b"\r\nContent-Length: 2\r\nConnection: close\r\n")
    for extra in (b"X-G: a\rContent-Length: 0\r\n", b"X-F: a\r\n b\r\n",
                  b"X-F: a\r\n\tb\r\n", b"X G: a\r\n", b"X-G: a\x01b\r\n",
                  b"Host: y\r\n"):
        assert raw(gw_py, head + extra + b"\r\n{}") == 400, extra
    assert executions(py, key) == 0, "a refused request reached the upstream"
    # Passed through too: refused, and the upstream answers nothing.
    assert raw(gw_py, b"GET /echo HTTP/1.1\r\nHost: x\r\nX-G: a\rGET /x HTTP/1.1\r\n"
               b"Connection: close\r\n\r\n") == 400
    assert raw(gw_py, b"GET /echo HTTP/1.1\r\nHost: x\r\nX-T: a\tb\r\n"
               b"Connection: close\r\n\r\n") == 200


def test_header_lines_forwarded(py, gw_py):
    """An empty header value reaches the upstream (libcurl would drop
    "Name:"); Content-Type twice is refused."""
    with socket.create_connection(("127.0.0.1", gw_py), timeout=10) as c:
        c.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nAccept:\r\n"
                  b"Connection: close\r\n\r\n")
        out = b""
        while True:
            d = c.recv(65536)
            if not d:
                break
            out += d
    names = [(k.lower(), v) for k, v in json.loads(out.split(b"\r\n\r\n", 1)[1])["headers"]]
    assert ("x-empty", "") in names and ("accept", "") in names, names
    assert raw(gw_py, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
               b"Content-Type: application/json\r\nContent-Length: 0\r\n"
               b"Connection: close\r\n\r\n") == 400


def test_targets_refused(py, gw_py, log):
    """Only an origin-form target of visible ASCII without '#' or dot
    segments is sent on, as sent; and spelling a keyed path with empty
    segments does not escape its route."""
    for target in (b"@127.0.0.1:%d/echo" % py, b".evil.com/", b"*", b"/x/../charges",
                   b"/x/%2e%2e/charges", b"/charges#f", b"/p\xff", b"/echo/./x"):
        assert raw(gw_py, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                   b"Connection: close\r\n\r\n") == 400, target
    s, _, b = req(gw_py, "GET", "/echo/a%2Fb/c..d?x=/../y")
    assert s == 200 and json.loads(b)["target"] == "/echo/a%2Fb/c..d?x=/../y", b
    h = {"Content-Type": "application/json"}
    for target in ("/charges/", "//charges", "/charges//"):
        s, _, b = req(gw_py, "POST", target, h, "{}")
        assert s == 400 and b"Idempotency-Key" in b, (target, s, b)  # keyed: needs a key
    key = new_key()
    h["Idempotency-Key"] = key
    # Python's http.server serves //charges as /charges: as the route.
    s1, _, _ = req(gw_py, "POST", "//charges", h, "{}")
    s2, h2, _ = req(gw_py, "POST", "//charges", h, "{}")
    assert (s1, s2) == (201, 201) and header(h2, "Idempotent-Replayed") == "true"
    assert executions(py, key) == 1
    # A path that is not UTF-8 is refused, and logged (escaped).
    gw = [int(m) for m in re.findall(r'"listen_port":"(\d+)"', open(log).read())][0]
    assert raw(gw, b"GET /q\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == 400

    def logged():
        return any(l.startswith("{") and json.loads(l).get("path") == "/q%FF%FE" and
                   json.loads(l).get("status") == 400 for l in open(log).read().splitlines())
    wait_until(logged, "the refused request's log line")


def test_key_sent_as_parsed(py, gw_py):
    """The upstream gets the key as parsed, once, whatever the client's
    spelling, and even when Connection names the header."""
    key = new_key()
    h = {"Idempotency-Key": ' "%s" ' % key, "Content-Type": "application/json"}
    assert req(gw_py, "POST", "/charges", h, "{}")[0] == 201
    assert executions(py, key) == 1
    key = new_key()
    h = {"Idempotency-Key": key, "Connection": "Idempotency-Key",
         "Content-Type": "application/json"}
    assert req(gw_py, "POST", "/charges", h, "{}")[0] == 201
    assert executions(py, key) == 1, "the key did not reach the upstream"


def test_answer_headers_not_utf8_kept(py, gw_py):
    """An answer whose Location or replayed header is not UTF-8 is kept
    byte for byte; never a 503 once the upstream ran the request."""
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    s1, h1, b1 = req(gw_py, "POST", "/charges?latin1=1", h, "{}")
    s2, h2, b2 = req(gw_py, "POST", "/charges?latin1=1", h, "{}")
    assert (s1, s2) == (201, 201) and b1 == b2, (s1, s2, b1, b2)
    assert header(h2, "Idempotent-Replayed") == "true"
    assert header(h2, "Location") == header(h1, "Location") == "/charges/1-caf\u00e9", h2
    assert header(h2, "X-Trace") == "t-1-caf\u00e9", h2
    assert executions(py, key) == 1


def test_request_header_not_utf8(py, gw_py):
    """A keyed request with a header value that is not UTF-8 (obs-text)
    is kept for a resend losslessly and reaches the upstream."""
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json",
         "X-Name": "caf\u00e9"}  # http.client sends it as latin-1: one byte 0xE9
    s, _, b = req(gw_py, "POST", "/charges", h, "{}")
    assert s == 201, (s, b)
    assert executions(py, key) == 1


def test_scope_absent_empty_repeated(py, gw_py):
    """No scope header and an empty one are two scopes; the header twice
    is refused."""
    key = new_key()
    body = "{}"
    base = "POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\n" \
        "Content-Type: application/json\r\nContent-Length: 2\r\n" % key
    assert req(gw_py, "POST", "/charges", {"Idempotency-Key": key,
                                           "Content-Type": "application/json"}, body)[0] == 201
    assert raw(gw_py, (base + "Authorization:\r\nConnection: close\r\n\r\n" + body)
               .encode()) == 201
    assert executions(py, key) == 2, executions(py, key)
    key2 = new_key()
    twice = base.replace(key, key2) + "Authorization: Bearer a\r\nAuthorization: Bearer b\r\n" \
        "Connection: close\r\n\r\n" + body
    assert raw(gw_py, twice.encode()) == 400
    assert executions(py, key2) == 0


def sql(db, statement):
    """Runs `statement` on the gateway's database `db` (fresh_db())."""
    if STORE_URL:
        subprocess.run(["psql", "-q", db, "-c", statement], check=True,
                       stdout=subprocess.DEVNULL)
    else:
        import sqlite3
        c = sqlite3.connect(db, timeout=10)
        c.execute(statement)
        c.commit()
        c.close()


def pending_rows(db):
    out = subprocess.run([IDEMD, "gateway", "pending", "--db", db], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    return [l.split() for l in out[1:]]


def test_resolver_stops_at_the_bound(py):
    """A pending request that has had its 10 attempts is never sent again,
    by any gateway: it stays pending for good."""
    db = fresh_db()
    g, gw, _, _ = start_gateway(py, ["POST /charges"], db=db)
    key = new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    assert req(gw, "POST", "/charges?lose=1", h, "{}")[0] == 202
    stop_gateway(g)
    assert executions(py, key) == 1
    # As if the resolver had sent it 10 times, and it is due.
    sql(db, "UPDATE gateway_requests SET attempts = 10, next_attempt_at = 0")
    g, gw, _, _ = start_gateway(py, ["POST /charges"], "--upstream-idempotent", "--lease",
                                "1500ms", "--upstream-timeout", "1s", db=db)
    # STATE, ROUTE (two words), KEY, ATTEMPTS, CREATED, NEXT, SCOPE
    wait_until(lambda: pending_rows(db)[0][6] == "never", "the resolver to take it")
    assert executions(py, key) == 1, "sent again past the bound: %d" % executions(py, key)
    rows = pending_rows(db)
    assert rows[0][0] == "pending" and rows[0][4] == "10", rows
    assert req(gw, "POST", "/charges?lose=1", h, "{}")[0] == 202
    stop_gateway(g)


def test_sigterm_under_keyed_load_keep_alive(py):
    """SIGTERM while clients keep sending keyed requests on kept-alive
    connections: the gateway exits 0; every request is answered, or its
    connection closed without an answer only when it was never reserved;
    a key answered 503 was never sent; and no key is left unsettled that
    was never sent (docs/gateway.md, "Stopping")."""
    db = fresh_db()
    g, port, _, _ = start_gateway(py, ["POST /charges"], db=db)
    sent = []  # (key, status or None)
    lock = threading.Lock()
    stop_at = [None]

    def client():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while True:
            if stop_at[0] and time.time() > stop_at[0] + 20:
                break
            key = new_key()
            status = None
            try:
                c.request("POST", "/charges?sleep=30", body=b'{"amount":1}',
                          headers={"Content-Type": "application/json",
                                   "Idempotency-Key": key})
                r = c.getresponse()
                r.read()
                status = r.status
            except (OSError, http.client.HTTPException):
                pass
            with lock:
                sent.append((key, status))
            if status is None:
                break
            if status == 503:  # stopping: it says so and closes
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.close()
    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop_at[0] = time.time()
    stop_gateway(g)
    took = time.time() - stop_at[0]
    for t in threads:
        t.join()
    assert any(s == 201 for _, s in sent), sent[:5]
    # Kept-alive clients do not hold it for the whole drain: a keyed
    # request after the signal is refused at once, its connection closed.
    assert took < 5, "took %.1fs to stop" % took
    assert any(s == 503 for _, s in sent), sent[-5:]
    executed = {}
    for key, status in sent:
        executed[key] = executions(py, key)
        if status == 201:
            assert executed[key] == 1, (key, status, executed[key])
        elif status == 503 or status is None:
            assert executed[key] == 0, (key, status, executed[key])
        else:
            assert status == 202, (key, status)
    for row in pending_rows(db):
        assert executed.get(row[2], 1) > 0, ("unsettled, never sent", row)


def test_sigterm_cuts_a_slow_stream(py):
    """A pass-through answer under way when the gateway stops is cut (the
    client sees it end short), so a slow upstream does not hold the
    shutdown; the gateway exits 0 at once (docs/gateway.md, "Stopping")."""
    g, port, _, _ = start_gateway(py, ["POST /charges"])
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/drip?ms=30000")
    r = c.getresponse()
    assert r.status == 200 and r.read(6) == b"first;"
    t0 = time.time()
    stop_gateway(g)
    took = time.time() - t0
    try:
        rest = r.read()
    except (OSError, http.client.HTTPException):
        rest = None
    c.close()
    assert rest != b"second;", rest
    assert took < 5, "took %.1fs to stop" % took


def test_logs_hold_key_ids_not_keys(log):
    text = open(log).read()
    lines = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    keyed = [l for l in lines if l.get("operation") == "gateway" and l.get("key_id")]
    assert keyed, "no keyed request lines"
    assert all(re.fullmatch(r"[0-9a-f]{16}", l["key_id"]) for l in keyed)
    for k in KEYS_SEEN:
        assert k not in text, "a raw key is in the log"




def main():
    failed = 0
    php = start_php()
    py = start_python_upstream()
    gw_p, gw, _, gw_log = start_gateway(php, ["POST /orders", "PUT /orders/{id}"])
    gwp_p, gw_py, admin_py, _ = start_gateway(py, ["POST /charges"], "--replay-header",
                                              "X-Trace")
    small_p, gw_small, _, _ = start_gateway(py, ["POST /charges", "GET /big"],
                                            "--max-answer", "1000")
    ctx = {"php": php, "py": py, "gw": gw, "gw_py": gw_py, "admin_py": admin_py,
           "gw_small": gw_small, "log": gw_log}
    tests = [v for k, v in globals().items() if k.startswith("test_")]
    only = sys.argv[1:]
    for t in tests:
        if only and t.__name__ not in only:
            continue
        args = [ctx[a] for a in t.__code__.co_varnames[:t.__code__.co_argcount]]
        try:
            t(*args)
            print("ok   %s" % t.__name__, flush=True)
        except Exception as e:  # report every test, then fail
            failed += 1
            print("FAIL %s: %r" % (t.__name__, e), flush=True)
            traceback.print_exc()
    for p in (gw_p, gwp_p, small_p):
        try:
            stop_gateway(p)
        except AssertionError as e:
            failed += 1
            print("FAIL stopping a gateway: %s" % e, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)
        shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(rc)
