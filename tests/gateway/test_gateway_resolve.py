#!/usr/bin/env python3
"""`idemd gateway resolve` and `idemd gateway audit` (docs/gateway.md,
"Resolving a pending key"): an operator completes a pending gateway key by
hand, audited, and its retries replay that answer; every refusal changes
nothing; a race with the gateway's resolver, or with another operator,
never completes a key twice.

Run by ctest as gateway_resolve (SQLite) and gateway_resolve_pg (through
scripts/with-pg.sh). Uses the helpers of test_gateway.py (the same
applications, gateways and databases); needs what it needs.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_gateway as g  # noqa: E402

IDEMD = g.IDEMD
REASON = "the application's row 1 was made, ticket 4521"


def resolve(db, key, *extra, route="POST /orders", status="201", reason=REASON,
            operator="alice"):
    args = [IDEMD, "gateway", "resolve", key, "--route", route, "--status", status,
            "--db", db]
    if reason is not None:
        args += ["--reason", reason]
    if operator is not None:
        args += ["--operator", operator]
    p = subprocess.run(args + list(extra), capture_output=True, timeout=60)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8",
                                                                             "replace")


def audit(db, key=None):
    args = [IDEMD, "gateway", "audit", "--db", db] + (["--key", key] if key else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def pending(db):
    out = subprocess.run([IDEMD, "gateway", "pending", "--db", db], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    return [line.split() for line in out[1:]]


def charge(key):
    return {"Idempotency-Key": key, "Content-Type": "application/json"}, "{}"


# ---- the tests ----

def test_operator_resolves_a_killed_upstreams_key():
    """The PHP application killed after its INSERT, before its answer, and
    no --upstream-idempotent: the key stays pending (202) until an
    operator, who found the application's row, resolves it with that
    answer; its retries then replay it, the audit holds the row, and a
    second resolve is refused with nothing changed."""
    marker = os.path.join(g.TMP, "die-once-resolve")
    open(marker, "w").close()
    port, php_p = g.start_php(work_ms=0, workers=0, die_marker=marker)
    db = g.fresh_db()
    gw_p, gw, _, _ = g.start_gateway(port, ["POST /orders"], "--upstream-timeout", "2s",
                                     db=db)
    key = g.new_key()
    s, hs, b = g.req(gw, "POST", "/orders", *g.order(key))
    assert s == 202 and g.header(hs, "Retry-After"), (s, b)
    php_p.wait(timeout=10)
    assert not os.path.exists(marker), "the application was not killed"
    g.start_php(work_ms=0, port=port, workers=0)
    s, hs, b = g.req(gw, "POST", "/orders", *g.order(key))
    assert s == 202 and g.header(hs, "Idempotent-Replayed") == "true", (s, b)
    rows = pending(db)
    assert len(rows) == 1 and rows[0][0] == "pending" and rows[0][3] == key, rows
    scope = rows[0][-1]
    # What the operator found in the application: its row 1.
    assert g.php_count(port) == 1
    s, _, row = g.req(port, "GET", "/orders/1")
    assert s == 200, s
    answer = row.decode().strip()

    rc, out, err = resolve(db, key, "--body", answer)
    assert rc == 0, (rc, out, err)
    for _ in range(2):
        s, hs, b = g.req(gw, "POST", "/orders", *g.order(key))
        assert s == 201 and g.header(hs, "Idempotent-Replayed") == "true", (s, hs, b)
        assert b.decode() == answer and g.header(hs, "Content-Type") == "application/json"
    s, _, _ = g.req(gw, "POST", "/orders", *g.order(key, quantity=3))
    assert s == 422, s  # the record keeps its request's fingerprint
    assert g.php_count(port) == 1, "the application ran the key again"
    assert pending(db) == [], pending(db)
    rows = audit(db, key)
    assert len(rows) == 1, rows
    assert {k: rows[0][k] for k in ("scope", "route", "key", "from", "to", "actor",
                                     "reason")} == {
        "scope": scope, "route": "POST /orders", "key": key, "from": "pending",
        "to": "completed", "actor": "operator:alice", "reason": REASON}, rows
    assert rows[0]["at"].endswith("Z"), rows
    assert audit(db) == rows  # the whole trail holds only this one

    # Resolved once: a second resolve is refused, and changes nothing.
    rc, out, err = resolve(db, key, status="500", reason="again")
    assert rc == 1 and "no pending" in err, (rc, err)
    rc, out, err = resolve(db, key, "--scope", scope, status="500", reason="again")
    assert rc == 1 and "completed, not pending" in err, (rc, err)
    assert audit(db, key) == rows
    s, hs, b = g.req(gw, "POST", "/orders", *g.order(key))
    assert s == 201 and b.decode() == answer, (s, b)
    g.stop_gateway(gw_p)


def test_refusals_change_nothing(py):
    """Bad usage is 2, a key that is not pending (unknown, on another route
    or scope, completed, processing under a live lease) is 1; after all of
    them the pending key is as it was: still pending, still listed, no
    audit row, and the application ran it once."""
    db = g.fresh_db()
    # Time enough for a request at the application to outlast the
    # command's wait for it (about 5 s) on a busy machine.
    gw_p, gw, _, _ = g.start_gateway(py, ["POST /charges"], "--upstream-timeout", "30s",
                                     "--lease", "40s", db=db)
    key = g.new_key()
    assert g.req(gw, "POST", "/charges?lose=1", *charge(key))[0] == 202
    before = pending(db)
    assert len(before) == 1 and before[0][3] == key, before
    scope = before[0][-1]
    body_file = os.path.join(g.TMP, "bin-%s" % key)
    with open(body_file, "wb") as f:
        f.write(b"\xff\x00binary")
    route = "POST /charges"
    usage = [
        dict(status="99"), dict(status="600"), dict(status="abc"), dict(status="150"),
        dict(status="201 "), dict(reason=""), dict(reason=None), dict(operator=None),
        dict(reason="two\nlines"), dict(reason=b"not \xff UTF-8"), dict(reason="r" * 201),
        dict(operator="al ice"), dict(route="POST"), dict(route="orders"),
        dict(extra=["--body", b"\xc3\x28"]),
        dict(extra=["--body", "{not json"]),
        dict(extra=["--body", "{}", "--body-file", body_file]),
        dict(extra=["--body-file", body_file]),  # binary, said to be JSON
        dict(extra=["--body-file", os.path.join(g.TMP, "no-such-file")]),
        dict(extra=["--content-type", "text/plain\r\nX-Evil: 1", "--body", "x"]),
        dict(extra=["--content-type", "plain"]),
        dict(extra=["--scope", "-4"]), dict(extra=["--scope", "x"]),
        dict(extra=["--key-ttl", "soon"]), dict(extra=["--bogus", "1"]),
        dict(extra=["--scope", scope, "--scope-value", "Bearer a"]),
        dict(status="204", extra=["--body", "{}"]),
        dict(key="has space"), dict(key=""),
    ]
    for u in usage:
        args = dict(route=route, status="201", reason=REASON, operator="alice")
        extra = u.pop("extra", [])
        k = u.pop("key", key)
        args.update(u)
        rc, out, err = resolve(db, k, *extra, **args)
        assert rc == 2 and err.strip(), (u, extra, rc, out, err)
    refused = [
        (g.new_key(), route, []),                  # unknown
        (key, "POST /other", []),                  # another route
        (key, route, ["--scope", "12345"]),        # another scope
    ]
    done = g.new_key()
    assert g.req(gw, "POST", "/charges", *charge(done))[0] == 201
    refused += [(done, route, []), (done, route, ["--scope", scope])]
    for k, r, extra in refused:
        rc, out, err = resolve(db, k, *extra, route=r)
        assert rc == 1 and ("no pending" in err or "not pending" in err), (k, r, rc, err)

    # In flight: its gateway holds the record under a live lease.
    busy = g.new_key()
    t = threading.Thread(target=lambda: g.req(gw, "POST", "/charges?sleep=15000",
                                              *charge(busy)))
    t.start()
    g.wait_until(lambda: g.executions(py, busy) == 1, "the application to act")
    rc, out, err = resolve(db, busy, route=route)
    assert rc == 1 and "is held right now" in err, (rc, err)
    t.join()
    s, hs, b = g.req(gw, "POST", "/charges?sleep=15000", *charge(busy))
    assert s == 201 and json.loads(b) == {"charge": 1, "key": busy}, (s, b)

    assert pending(db) == before, (pending(db), before)
    assert audit(db) == [], audit(db)
    s, hs, b = g.req(gw, "POST", "/charges?lose=1", *charge(key))
    assert s == 202 and g.header(hs, "Idempotent-Replayed") == "true", (s, b)
    assert g.executions(py, key) == 1
    # And then it resolves, with a body of any bytes and its own type.
    rc, out, err = resolve(db, key, "--body-file", body_file, "--content-type",
                           "application/octet-stream", route=route, status="200")
    assert rc == 0, (rc, err)
    s, hs, b = g.req(gw, "POST", "/charges?lose=1", *charge(key))
    assert (s, b) == (200, b"\xff\x00binary"), (s, b)
    assert g.header(hs, "Content-Type") == "application/octet-stream"
    assert g.header(hs, "Idempotent-Replayed") == "true"
    g.stop_gateway(gw_p)


def test_a_key_in_two_scopes(py):
    """Two clients (two Authorization values) left the same key pending:
    without a scope the operator is told both and nothing changes; with
    --scope-value (the client's header value) or --scope (the number
    listed) each is resolved alone, and only its client gets the answer."""
    db = g.fresh_db()
    gw_p, gw, _, _ = g.start_gateway(py, ["POST /charges"], db=db)
    key = g.new_key()
    h = {name: dict(charge(key)[0], Authorization="Bearer " + name) for name in "ab"}
    for name in "ab":
        assert g.req(gw, "POST", "/charges?lose=1", h[name], "{}")[0] == 202
    rows = pending(db)
    assert len(rows) == 2 and {r[3] for r in rows} == {key}, rows
    rc, out, err = resolve(db, key, route="POST /charges")
    assert rc == 1 and "2 scopes" in err and all(r[-1] in err for r in rows), (rc, err)
    assert pending(db) == rows and audit(db) == []
    rc, out, err = resolve(db, key, "--scope-value", "Bearer a", "--body", '{"for":"a"}',
                           route="POST /charges")
    assert rc == 0, (rc, err)
    s, hs, b = g.req(gw, "POST", "/charges?lose=1", h["a"], "{}")
    assert (s, b) == (201, b'{"for":"a"}') and g.header(hs, "Idempotent-Replayed") == "true"
    assert g.req(gw, "POST", "/charges?lose=1", h["b"], "{}")[0] == 202
    left = pending(db)
    assert len(left) == 1, left
    [row] = audit(db)
    assert row["scope"] != left[0][-1] and row["scope"] in {r[-1] for r in rows}, (row, left)
    rc, out, err = resolve(db, key, "--scope", left[0][-1], "--body", '{"for":"b"}',
                           route="POST /charges")
    assert rc == 0, (rc, err)
    s, _, b = g.req(gw, "POST", "/charges?lose=1", h["b"], "{}")
    assert (s, b) == (201, b'{"for":"b"}'), (s, b)
    assert pending(db) == [] and len(audit(db, key)) == 2
    g.stop_gateway(gw_p)


def test_operators_at_once_complete_once(py):
    """Four operators resolve one pending key at once, each with a body of
    their own: exactly one succeeds, the others are refused, the audit has
    one row, and retries replay the winner's answer."""
    db = g.fresh_db()
    gw_p, gw, _, _ = g.start_gateway(py, ["POST /charges"], db=db)
    key = g.new_key()
    assert g.req(gw, "POST", "/charges?lose=1", *charge(key))[0] == 202
    names = ["op%d" % i for i in range(4)]
    results = [None] * 4

    def run(i):
        results[i] = resolve(db, key, "--body", json.dumps({"by": names[i]}),
                             route="POST /charges", operator=names[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in enumerate(results) if r[0] == 0]
    assert len(winners) == 1, results
    assert all(r[0] == 1 for i, r in enumerate(results) if i not in winners), results
    rows = audit(db, key)
    assert len(rows) == 1 and rows[0]["actor"] == "operator:" + names[winners[0]], rows
    s, hs, b = g.req(gw, "POST", "/charges?lose=1", *charge(key))
    assert s == 201 and json.loads(b) == {"by": names[winners[0]]}, (s, b)
    g.stop_gateway(gw_p)


def test_race_with_the_resolver_completes_once(py):
    """With --upstream-idempotent the resolver sends a pending request
    again about a second after its answer was lost; operators resolve
    such keys at moments around then. Each key is completed once: by the
    operator (exit 0, one audit row, its answer replayed) or by the
    resolver (the operator refused, no audit row, the application's
    answer replayed); the application ran each key once."""
    db = g.fresh_db()
    gw_p, gw, _, _ = g.start_gateway(py, ["POST /charges"], "--upstream-idempotent",
                                     db=db)
    target = "/charges?lose=1&honour=1"
    keys = [g.new_key() for _ in range(8)]
    results = {}

    def operator(i, key):
        time.sleep(0.4 * i)  # spread over the resolver's first resend
        results[key] = resolve(db, key, "--body", json.dumps({"by": "operator"}),
                               route="POST /charges", status="200")
    threads = []
    for i, key in enumerate(keys):
        assert g.req(gw, "POST", target, *charge(key))[0] == 202
        t = threading.Thread(target=operator, args=(i, key))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    won = 0
    for key in keys:
        g.wait_until(lambda: g.req(gw, "POST", target, *charge(key))[0] != 202,
                     "the key to settle", tries=600)
        rc, out, err = results[key]
        rows = audit(db, key)
        answers = {g.req(gw, "POST", target, *charge(key))[2] for _ in range(2)}
        assert len(answers) == 1, answers
        if rc == 0:
            won += 1
            assert len(rows) == 1 and rows[0]["actor"] == "operator:alice", rows
            assert answers == {b'{"by": "operator"}'}, answers
        else:
            # settled and gone from the pending ones, settled as it was
            # read, or held by the resolver until the wait ran out
            assert rc == 1 and any(w in err for w in ("no pending", "not pending", "held")), (
                rc, err)
            assert rows == [], rows
            assert answers == {json.dumps({"charge": 1, "key": key}).encode()}, answers
        assert g.executions(py, key) == 1, key
    assert pending(db) == []
    print("     the operator completed %d of %d keys, the resolver the rest"
          % (won, len(keys)))
    g.stop_gateway(gw_p)


def main():
    failed = 0
    py = g.start_python_upstream()
    ctx = {"py": py}
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
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        for p in g.procs:
            if p.poll() is None:
                g.stop(p)
        shutil.rmtree(g.TMP, ignore_errors=True)
    sys.exit(rc)
