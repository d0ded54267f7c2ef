#!/usr/bin/env python3
"""docs/idempotency.md, section 2: cases against examples/embed's server at URL (argv[1]),
whose SQLite database is argv[2]: twenty concurrent requests with one key
make one note and get twenty identical answers; another body under the key
gets 422; a later retry replays the first answer with its marker; bad keys
get 400. Exits non-zero, saying which case failed, on any difference."""
import http.client
import json
import sqlite3
import sys
import threading
import urllib.parse

URL, DB = sys.argv[1], sys.argv[2]
HOST = urllib.parse.urlsplit(URL)
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def request(method, path, body=None, key=None):
    """(status, headers as a dict of lower-case names, body text)."""
    conn = http.client.HTTPConnection(HOST.hostname, HOST.port, timeout=20)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return (resp.status, {k.lower(): v for k, v in resp.getheaders()},
                resp.read().decode())
    finally:
        conn.close()


def notes():
    """The notes in the store: the effects, counted where they are written."""
    db = sqlite3.connect("file:%s?mode=ro" % DB, uri=True, timeout=10)
    try:
        return db.execute("SELECT count(*) FROM notes").fetchone()[0]
    finally:
        db.close()


def replayed(headers):
    return headers.get("idempotent-replayed") == "true"


# 1. Twenty at once, one key, one body: one note, twenty identical answers,
# one of them the original and nineteen replays (the waiting ones too).
N = 20
body = json.dumps({"text": "buy milk"})
start = threading.Barrier(N)
answers = [None] * N


def racer(i):
    try:
        start.wait(timeout=20)
        answers[i] = request("POST", "/notes", body, key="race-1")
    except Exception as e:  # recorded, so that the case fails
        answers[i] = (0, {}, repr(e))


threads = [threading.Thread(target=racer, args=(i,)) for i in range(N)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
check(all(not t.is_alive() for t in threads), "all racers finished")
check(all(a is not None and a[0] == 201 for a in answers),
      "20 racers: all 201 (got %s)" % sorted(str(a and a[0]) for a in answers))
bodies = {a[2] for a in answers if a}
check(len(bodies) == 1, "20 racers: one body (got %d different)" % len(bodies))
first = json.loads(answers[0][2]) if answers[0] and answers[0][0] == 201 else {}
note_id = first.get("id", "")
check(note_id.startswith("note_") and first.get("text") == "buy milk",
      "20 racers: the note (got %r)" % answers[0][2])
check(len({a[1].get("location") for a in answers if a}) == 1,
      "20 racers: one Location")
marked = sum(1 for a in answers if a and replayed(a[1]))
check(marked == N - 1, "20 racers: 19 marked Idempotent-Replayed (got %d)" % marked)
check(notes() == 1, "20 racers: exactly one note in the store (got %d)" % notes())
status, _, text = request("GET", "/notes/" + note_id)
check(status == 200 and json.loads(text) == first, "GET the note (got %d %s)" % (status, text))

# 2. Another body under the same key: 422, and nothing written.
status, headers, text = request("POST", "/notes", json.dumps({"text": "buy bread"}), key="race-1")
check(status == 422, "another body under the key: 422 (got %d %s)" % (status, text))
check(not replayed(headers), "a 422 is not marked as a replay")
check(notes() == 1, "after the mismatch: still one note (got %d)" % notes())

# 3. A later retry of the first request: the first answer, marked.
status, headers, text = request("POST", "/notes", body, key="race-1")
check(status == 201 and text == answers[0][2],
      "a retry replays the first answer (got %d %s)" % (status, text))
check(replayed(headers), "a retry has Idempotent-Replayed: true")
check(notes() == 1, "after the retry: still one note (got %d)" % notes())

# 4. A missing or bad key: 400, nothing written. A new key: a second note.
for key, what in ((None, "missing"), ("", "empty"), ("a b", "a space inside"),
                  ("k" * 256, "256 characters")):
    status, _, text = request("POST", "/notes", body, key=key)
    check(status == 400, "%s key: 400 (got %d %s)" % (what, status, text))
status, headers, text = request("POST", "/notes", body, key="race-2")
check(status == 201 and not replayed(headers) and json.loads(text).get("id") != note_id,
      "a new key makes a new note (got %d %s)" % (status, text))
check(notes() == 2, "two keys, two notes (got %d)" % notes())

if failures:
    print("conformance: %d case(s) failed" % len(failures), file=sys.stderr)
    sys.exit(1)
print("conformance: all cases passed")
