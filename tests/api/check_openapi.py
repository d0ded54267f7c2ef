#!/usr/bin/env python3
"""Checks docs/openapi.yaml against the real idemd.

Starts the idemd binary given as the first argument on a fresh temp dir,
SQLite file and loopback port (sandbox flags make it decline, lose and fail
to reach the provider for chosen amounts, and make payments slow enough for
a duplicate to get 409; IDEM_FAULT_FILE makes its store fail on demand; a
second idemd with --max-connections 1 answers 503 to a second connection),
drives every documented route through every status it can produce, and
checks each answer against the document:

  - the path and method are documented (or the answer is one of the
    x-unmatched-responses: 404 for an unknown path, 405 with Allow for a
    method the path does not take, 503 at --max-connections; or, without
    X-Request-Id, one of the x-transport-responses libmicrohttpd writes);
  - the status is documented for that operation;
  - the Content-Type is a documented media type and the body validates
    against the documented JSON Schema (HEAD: no body);
  - required response headers are present and every documented header that
    is present matches its schema;
  - security: an operation that needs credentials answers 401 without
    them, one that does not never answers 401;
  - a request body the server accepted validates against the documented
    request schema, and the bodies the server rejected field by field (422)
    are rejected by that schema too;
  - Idempotent-Replayed: true exactly when the body has "replayed": true.

Then every documented status of every operation must have been produced,
except the few listed in NOT_PRODUCED with the reason. Finally the checker
checks itself: a series of broken copies of the document must each be
rejected on the same recorded answers.

Only the Python standard library, PyYAML and jsonschema (Debian packages
python3, python3-yaml, python3-jsonschema); HTTP only to 127.0.0.1.

usage: check_openapi.py PATH/TO/idemd [PATH/TO/openapi.yaml]
"""

import copy
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import jsonschema
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DOC = os.path.join(HERE, '..', '..', 'docs', 'openapi.yaml')

METHODS = ('get', 'put', 'post', 'delete', 'options', 'head', 'patch', 'trace')

# Documented statuses this test cannot make the server produce, and why:
# (where, status); where is an operation's path template, '*' for any, or
# the name of a root extension.
NOT_PRODUCED = {
    ('*', '500'): 'only when idemd runs out of memory',
    ('x-transport-responses', '400'):
        'a malformed Content-Length or chunk, which urllib does not send '
        '(fuzz/fuzz_request and tests/integration/test_limits.c send raw bytes)',
    ('x-transport-responses', '505'):
        'a request line with another HTTP version, which urllib does not send',
}


def excused(where, status):
    return ('*', status) in NOT_PRODUCED or (where, status) in NOT_PRODUCED

# Sandbox amounts (see `idemd --help`).
DECLINE, UNCERTAIN, UNAVAILABLE = 4020, 2020, 5030
SANDBOX_DELAY = '300ms'   # every charge takes this long...
INFLIGHT_WAIT = '50ms'    # ...so a duplicate gives up waiting: 409

# The provider's events' secret (--provider-webhook-secret).
WEBHOOK_SECRET = 'whsec_openapi'

SANITIZER_MARKS = ('ERROR: AddressSanitizer', 'ERROR: LeakSanitizer',
                   'runtime error:', 'ThreadSanitizer')

# Never through a proxy, whatever the environment says.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Failure(Exception):
    pass


# ---------------------------------------------------------------------------
# The document


def load_doc(path):
    try:
        with open(path, encoding='utf-8') as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise Failure('cannot read %s: %s' % (path, e))
    if not isinstance(doc, dict):
        raise Failure('%s is not a YAML mapping' % path)
    return doc


def pointer(doc, ref):
    if not ref.startswith('#/'):
        raise Failure('only local $ref are supported: %s' % ref)
    node = doc
    for part in ref[2:].split('/'):
        part = part.replace('~1', '/').replace('~0', '~')
        if not isinstance(node, dict) or part not in node:
            raise Failure('$ref %s does not resolve' % ref)
        node = node[part]
    return node


def deref(doc, node, depth=0):
    """A copy of `node` with every local $ref replaced by its target."""
    if depth > 64:
        raise Failure('$ref nesting too deep (a cycle?)')
    if isinstance(node, dict):
        if '$ref' in node:
            target = deref(doc, pointer(doc, node['$ref']), depth + 1)
            rest = {k: v for k, v in node.items() if k != '$ref'}
            if not rest:
                return target
            # OpenAPI 3.1 lets a schema $ref have siblings: both apply.
            return {'allOf': [target, deref(doc, rest, depth + 1)]}
        return {k: deref(doc, v, depth + 1) for k, v in node.items()}
    if isinstance(node, list):
        return [deref(doc, v, depth + 1) for v in node]
    return node


def sanity(doc):
    """Structural checks of the document itself; returns problems."""
    problems = []
    if not str(doc.get('openapi', '')).startswith('3.1'):
        problems.append('openapi is not 3.1.x')
    for k in ('title', 'version'):
        if not (doc.get('info') or {}).get(k):
            problems.append('info.%s missing' % k)
    schemes = ((doc.get('components') or {}).get('securitySchemes') or {})
    for name, s in schemes.items():
        if s.get('type') == 'http' and s.get('scheme') != 'bearer':
            problems.append('security scheme %s is not bearer' % name)
    try:
        full = deref(doc, doc)
    except Failure as e:
        return problems + [str(e)]
    for path, item in (full.get('paths') or {}).items():
        for method, op in item.items():
            if method not in METHODS:
                continue
            where = '%s %s' % (method.upper(), path)
            for req in op.get('security', full.get('security', [])):
                for name in req:
                    if name not in schemes:
                        problems.append('%s: unknown security scheme %s' % (where, name))
            if not op.get('responses'):
                problems.append('%s: no responses' % where)
            for status, resp in (op.get('responses') or {}).items():
                if not re.fullmatch(r'[1-5][0-9][0-9]', str(status)):
                    problems.append('%s: response key %r is not a status' % (where, status))
                if not resp.get('description'):
                    problems.append('%s %s: no description' % (where, status))
            for names in re.findall(r'{([^}]+)}', path):
                params = [p for p in item.get('parameters', []) + op.get('parameters', [])
                          if p.get('in') == 'path' and p.get('name') == names]
                if not params:
                    problems.append('%s: path parameter {%s} not declared' % (where, names))
    for schema in iter_schemas(full):
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.exceptions.SchemaError as e:
            problems.append('invalid JSON Schema: %s' % e.message)
    return problems


def iter_schemas(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == 'schema' and isinstance(v, dict):
                yield v
            else:
                yield from iter_schemas(v)
    elif isinstance(node, list):
        for v in node:
            yield from iter_schemas(v)


def validator(schema):
    return jsonschema.Draft202012Validator(schema)


def schema_errors(schema, value):
    return [e.message for e in validator(schema).iter_errors(value)]


def path_regex(template):
    out, pos = '', 0
    for m in re.finditer(r'{([^}]+)}', template):
        out += re.escape(template[pos:m.start()]) + '(?P<%s>[^/]+)' % m.group(1)
        pos = m.end()
    return re.compile(out + re.escape(template[pos:]))


def match_path(full, path):
    """(template, path item) of the documented path `path` falls under, or
    (None, None). A path parameter that does not match its schema does not
    match."""
    for template, item in (full.get('paths') or {}).items():
        m = path_regex(template).fullmatch(path)
        if not m:
            continue
        ok = True
        for name, value in m.groupdict().items():
            params = [p for p in item.get('parameters', [])
                      if p.get('in') == 'path' and p.get('name') == name]
            for op in item.values():
                if isinstance(op, dict):
                    params += [p for p in op.get('parameters', [])
                               if p.get('in') == 'path' and p.get('name') == name]
            for p in params[:1]:
                if schema_errors(p.get('schema', {}), value):
                    ok = False
        if ok:
            return template, item
    return None, None


def header_value(schema, raw):
    """The header string as the type its schema names (headers are text)."""
    t = schema.get('type')
    if t == 'integer':
        return int(raw) if re.fullmatch(r'-?[0-9]+', raw) else raw
    if t == 'number':
        try:
            return float(raw)
        except ValueError:
            return raw
    if t == 'boolean':
        return {'true': True, 'false': False}.get(raw, raw)
    return raw


# ---------------------------------------------------------------------------
# Checking answers


def check_response(resp, ex, where):
    problems = []
    hdrs = ex['headers']
    for name, h in (resp.get('headers') or {}).items():
        if name.lower() == 'content-type':
            continue  # OpenAPI: described by `content`
        raw = hdrs.get(name.lower())
        if raw is None:
            if h.get('required'):
                problems.append('%s: required header %s missing' % (where, name))
            continue
        schema = h.get('schema') or {}
        for msg in schema_errors(schema, header_value(schema, raw)):
            problems.append('%s: header %s %r: %s' % (where, name, raw, msg))

    content = resp.get('content')
    ctype = hdrs.get('content-type', '').split(';')[0].strip().lower()
    body = ex['body']
    if not content:
        if body:
            problems.append('%s: a body although none is documented' % where)
        return problems
    if not ctype and resp.get('x-content-type-missing') and len(content) == 1:
        ctype = next(iter(content)).lower()  # documented: sent without the header
    if ctype not in {k.lower() for k in content}:
        problems.append('%s: Content-Type %r not documented (%s)'
                        % (where, ctype, ', '.join(content)))
        return problems
    if ex['method'] == 'HEAD':
        if body:
            problems.append('%s: HEAD answered with a body' % where)
        return problems
    media = {k.lower(): v for k, v in content.items()}[ctype] or {}
    schema = media.get('schema')
    if schema is None:
        return problems
    if ctype == 'application/json':
        try:
            value = json.loads(body.decode('utf-8'))
        except (UnicodeDecodeError, ValueError):
            return problems + ['%s: body is not JSON: %.200r' % (where, body)]
    else:
        try:
            value = body.decode('utf-8')
        except UnicodeDecodeError:
            return problems + ['%s: body is not UTF-8 text' % where]
    for msg in schema_errors(schema, value):
        problems.append('%s: body %s does not match the schema: %s'
                        % (where, json.dumps(value)[:300] if ctype == 'application/json'
                           else repr(value[:120]), msg))
    return problems


def operation_security(full, op):
    return op.get('security', full.get('security', []))


def check_exchange(full, ex):
    """Problems with one recorded answer; also returns the key it covers."""
    problems = []
    method, path, status = ex['method'], ex['path'], str(ex['status'])
    where = '%s %s -> %s (%s)' % (method, path, status, ex['label'])
    transport = {str(k): v for k, v in (full.get('x-transport-responses') or {}).items()}
    if 'x-request-id' not in ex['headers']:
        # Not written by idemd: only a documented transport answer may say so.
        if status not in transport:
            problems.append('%s: no X-Request-Id, and %s is not one of the '
                            'x-transport-responses' % (where, status))
            return problems, None
        return check_response(transport[status], ex, where), ('x-transport-responses', status)

    template, item = match_path(full, path)
    op = item.get(method.lower()) if item else None
    if op is None:
        unmatched = {str(k): v for k, v in (full.get('x-unmatched-responses') or {}).items()}
        want = '404' if template is None else '405'
        if status == '503' and status in unmatched:
            want = '503'  # the connection cap comes before the routes
        if status != want or status not in unmatched:
            problems.append('%s: %s is not documented (%s); expected the documented %s '
                            'of x-unmatched-responses' % (
                                where, '%s %s' % (method, path),
                                'unknown path' if template is None else
                                'method not documented for ' + template, want))
            return problems, None
        problems += check_response(unmatched[status], ex, where)
        if status == '405':
            allow = {m.strip() for m in ex['headers'].get('allow', '').split(',') if m.strip()}
            documented = {m.upper() for m in item if m in METHODS}
            if allow != documented:
                problems.append('%s: Allow %s but the document has %s for %s'
                                % (where, sorted(allow), sorted(documented), template))
        return problems, ('x-unmatched-responses', status)

    key = (template, method.lower())
    responses = {str(k): v for k, v in (op.get('responses') or {}).items()}
    if status not in responses:
        problems.append('%s: status %s is not documented for %s %s (documented: %s)'
                        % (where, status, method, template, ', '.join(sorted(responses))))
        return problems, None
    problems += check_response(responses[status], ex, where)

    # Security as documented.
    secured = bool(operation_security(full, op))
    sent_auth = 'authorization' in {k.lower() for k in ex['req_headers']}
    if not secured and status == '401':
        problems.append('%s: 401 although the document says no security' % where)
    if secured and not sent_auth and status != '401':
        problems.append('%s: answered %s without credentials although the document '
                        'requires them' % (where, status))

    # Required header parameters: missing one cannot succeed.
    params = (item.get('parameters') or []) + (op.get('parameters') or [])
    sent = {k.lower() for k in ex['req_headers']}
    for p in params:
        if p.get('in') == 'header' and p.get('required') and p['name'].lower() not in sent:
            if status.startswith('2'):
                problems.append('%s: succeeded without the required header %s'
                                % (where, p['name']))

    # The request body, as documented.
    rb = ((op.get('requestBody') or {}).get('content') or {}).get('application/json')
    if rb and rb.get('schema') is not None and ex.get('req_json') is not None:
        errs = schema_errors(rb['schema'], ex['req_json'])
        body = parse_json(ex['body']) if ex['method'] != 'HEAD' else None
        validation_422 = status == '422' and isinstance(body, dict) and 'errors' in body
        accepted = status in ('200', '201', '202', '402', '409') or (
            status == '422' and not validation_422)
        if accepted and errs:
            problems.append('%s: the server accepted a body the documented request '
                            'schema rejects: %s' % (where, errs[0]))
        if validation_422 and ex.get('schema_must_reject') and not errs:
            problems.append('%s: the server rejected the body field by field but the '
                            'documented request schema accepts it: %s'
                            % (where, json.dumps(ex['req_json'])[:200]))

    # Replays, as documented for Idempotent-Replayed.
    body = parse_json(ex['body']) if ex['method'] != 'HEAD' else None
    replayed_header = ex['headers'].get('idempotent-replayed') == 'true'
    replayed_body = isinstance(body, dict) and body.get('replayed') is True
    if replayed_header != replayed_body:
        problems.append('%s: Idempotent-Replayed %s but body replayed %s'
                        % (where, replayed_header, replayed_body))
    return problems, (key, status)


def parse_json(raw):
    try:
        return json.loads(raw.decode('utf-8'))
    except (UnicodeDecodeError, ValueError):
        return None


def check_all(doc, exchanges):
    """Every problem of the document against the recorded answers."""
    problems = sanity(doc)
    try:
        full = deref(doc, doc)
    except Failure as e:
        return problems + [str(e)]
    covered = set()
    for ex in exchanges:
        p, cov = check_exchange(full, ex)
        problems += p
        if cov:
            covered.add(cov)
        if ex.get('expect') is not None and ex['status'] != ex['expect']:
            problems.append('%s %s (%s): expected %s, got %s: %.200r' % (
                ex['method'], ex['path'], ex['label'], ex['expect'], ex['status'], ex['body']))
    # Every documented status was produced (or is excused).
    for template, item in (full.get('paths') or {}).items():
        for method, op in item.items():
            if method not in METHODS:
                continue
            for status in op.get('responses') or {}:
                status = str(status)
                if excused(template, status):
                    continue
                if ((template, method), status) not in covered:
                    problems.append('%s %s: documented status %s was never produced'
                                    % (method.upper(), template, status))
    for ext in ('x-unmatched-responses', 'x-transport-responses'):
        for status in (full.get(ext) or {}):
            status = str(status)
            if not excused(ext, status) and (ext, status) not in covered:
                problems.append('%s: %s was never produced' % (ext, status))
    return problems


# ---------------------------------------------------------------------------
# The server


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
    s.close()
    return port


def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith('IDEMD_')}


class Server:
    def __init__(self, idemd, flags):
        self.idemd = idemd
        self.dir = tempfile.mkdtemp(prefix='idem-openapi-')
        self.db = os.path.join(self.dir, 'idem.db')
        self.log = os.path.join(self.dir, 'idemd.log')
        # While this file exists, every store call of this idemd fails
        # (IDEM_FAULT_FILE, a test hook: docs/hardening.md).
        self.fault = os.path.join(self.dir, 'store-fault')
        self.flags = flags
        self.proc = None
        self.port = None

    def cli(self, *args):
        r = subprocess.run([self.idemd] + list(args) + ['--db', self.db],
                           capture_output=True, text=True, env=clean_env(), timeout=30)
        if r.returncode != 0:
            raise Failure('idemd %s failed (%d): %s' % (' '.join(args), r.returncode, r.stderr))
        return r.stdout

    def start(self):
        for _ in range(5):
            self.port = free_port()
            logf = open(self.log, 'ab')
            env = clean_env()
            env['IDEM_FAULT_FILE'] = self.fault
            self.proc = subprocess.Popen(
                [self.idemd, 'serve', '--db', self.db,
                 '--listen', '127.0.0.1:%d' % self.port] + self.flags,
                stdout=logf, stderr=logf, env=env)
            logf.close()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with OPENER.open('http://127.0.0.1:%d/healthz' % self.port, timeout=2) as r:
                        if r.status == 200:
                            return
                except (OSError, urllib.error.URLError):
                    pass
                time.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
                raise Failure('idemd did not become healthy:\n' + self.log_text()[-2000:])
        raise Failure('idemd could not start (port races?):\n' + self.log_text()[-2000:])

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise Failure('idemd did not exit within 30 s of SIGTERM')

    def log_text(self):
        try:
            with open(self.log, encoding='utf-8', errors='replace') as f:
                return f.read()
        except OSError:
            return ''

    def sql(self, statement):
        """Runs one read on the database."""
        con = sqlite3.connect(self.db, timeout=10, isolation_level=None)
        try:
            return con.execute(statement).fetchall()
        finally:
            con.close()

    def store_fault(self, on):
        if on:
            open(self.fault, 'w').close()
        elif os.path.exists(self.fault):
            os.unlink(self.fault)


def stop_clean(server):
    """SIGTERM; the exit status must be 0 and the log free of sanitizer
    reports."""
    rc = server.stop()
    log = server.log_text()
    if rc != 0:
        raise Failure('idemd exited %s after SIGTERM:\n%s' % (rc, log[-2000:]))
    for mark in SANITIZER_MARKS:
        if mark in log:
            raise Failure('sanitizer report in the idemd log:\n' + log[-4000:])


# ---------------------------------------------------------------------------
# Driving the API


class Driver:
    def __init__(self, server, exchanges=None):
        self.s = server
        self.base = 'http://127.0.0.1:%d' % server.port
        self.exchanges = exchanges if exchanges is not None else []
        self.lock = threading.Lock()

    def call(self, method, path, expect, label, token=None, key=None, body=None,
             ctype='application/json', headers=None, chunked=False, reject=False):
        """One request; records the answer. `body`: a dict/list (sent as
        JSON), bytes (sent as is) or None. `reject`: a body the documented
        request schema must reject (the server answers 422 field by field)."""
        h = dict(headers or {})
        if token is not None:
            h['Authorization'] = 'Bearer ' + token
        if key is not None:
            h['Idempotency-Key'] = key
        req_json = None
        data = None
        if body is not None:
            if isinstance(body, (bytes, bytearray)):
                data = bytes(body)
                req_json = parse_json(data)
            else:
                req_json = body
                data = json.dumps(body).encode()
            if ctype is not None:
                h['Content-Type'] = ctype
        sent = data
        if chunked and data is not None:
            half = len(data) // 2
            sent = iter([data[:half], data[half:]])  # urllib: Transfer-Encoding: chunked
        status, hdrs, raw = None, {}, b''
        for attempt in range(3):
            req = urllib.request.Request(self.base + path, data=sent, method=method, headers=h)
            try:
                with OPENER.open(req, timeout=30) as resp:
                    status, hdrs, raw = resp.status, resp.headers, resp.read()
            except urllib.error.HTTPError as e:
                status, hdrs, raw = e.code, e.headers, e.read()
            except (ConnectionError, urllib.error.URLError) as e:
                # The server may answer early (413) and close while we send.
                if attempt == 2:
                    raise Failure('%s %s (%s): %s' % (method, path, label, e))
                if chunked and data is not None:
                    sent = iter([data[:len(data) // 2], data[len(data) // 2:]])
                time.sleep(0.1)
                continue
            break
        ex = {
            'method': method, 'path': path, 'label': label, 'expect': expect,
            'req_headers': h, 'req_json': req_json if isinstance(req_json, dict) else None,
            'schema_must_reject': reject,
            'status': status, 'headers': {k.lower(): v for k, v in hdrs.items()},
            'body': raw,
        }
        with self.lock:
            self.exchanges.append(ex)
        return ex


def body_json(ex):
    return parse_json(ex['body'])


def drive(d, tok, other, server):
    P = '/payments'
    O = '/orders'
    order = {'customer_id': 'c1', 'items': [{'sku': 'A1', 'quantity': 2, 'unit_price': 1000}],
             'currency': 'BRL'}

    # --- POST /payments: every outcome, first answers and replays.
    first = d.call('POST', P, 201, 'new payment', tok, 'pay-new',
                   {'amount': 15990, 'currency': 'BRL', 'order_id': 'ord_42'},
                   headers={'X-Request-Id': 'openapi-check-1'})
    if first['headers'].get('x-request-id') != 'openapi-check-1':
        raise Failure('X-Request-Id was not echoed: %r' % first['headers'].get('x-request-id'))
    d.call('POST', P, 201, 'replay (same body, other spelling)', tok, 'pay-new',
           {'order_id': 'ord_42', 'amount': '15990'})
    d.call('POST', P, 201, 'digits, default currency, charset', tok, 'pay-digits',
           {'amount': '007'}, ctype='application/json; charset=utf-8')
    d.call('POST', P, 201, 'quoted key, null fields', tok, '"pay-quoted"',
           {'amount': 100, 'currency': None, 'order_id': None})
    declined = d.call('POST', P, 402, 'declined', tok, 'pay-declined', {'amount': DECLINE})
    d.call('POST', P, 402, 'declined, replay', tok, 'pay-declined', {'amount': DECLINE})
    pending = d.call('POST', P, 202, 'outcome unknown', tok, 'pay-pending', {'amount': UNCERTAIN})
    d.call('POST', P, 202, 'outcome unknown, replay', tok, 'pay-pending', {'amount': UNCERTAIN})
    d.call('POST', P, 503, 'provider unreachable', tok, 'pay-unavailable',
           {'amount': UNAVAILABLE})
    d.call('POST', P, 503, 'provider unreachable, runs again', tok, 'pay-unavailable',
           {'amount': UNAVAILABLE})
    d.call('POST', P, 422, 'key reused with another body', tok, 'pay-new', {'amount': 1})
    d.call('POST', P, 422, 'key of a declined payment reused', tok, 'pay-declined',
           {'amount': 1})
    for label, bad in [
        ('amount 0', {'amount': 0}),
        ('amount -5', {'amount': -5}),
        ('amount 1.5', {'amount': 1.5}),
        ('amount missing', {'currency': 'BRL'}),
        ('amount not digits', {'amount': '100; DROP TABLE payments'}),
        ('amount a bool', {'amount': True}),
        ('currency lower case', {'amount': 1, 'currency': 'brl'}),
        ('order_id empty', {'amount': 1, 'order_id': ''}),
        ('order_id a number', {'amount': 1, 'order_id': 7}),
        ('order_id with a space', {'amount': 1, 'order_id': 'a b'}),
        ('unknown field', {'amount': 1, 'fee': 2}),
    ]:
        d.call('POST', P, 422, label, tok, 'pay-invalid', bad, reject=True)
    d.call('POST', P, 201, 'key left free by the 422s', tok, 'pay-invalid', {'amount': 5})

    # 409: a duplicate while the first (slow provider) is still processing.
    slow = {}
    t = threading.Thread(target=lambda: slow.update(
        ex=d.call('POST', P, 201, 'slow original', tok, 'pay-slow', {'amount': 777})))
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = server.sql("SELECT count(*) FROM idempotency_records WHERE key = 'pay-slow' "
                          "AND state = 'processing'")
        if rows[0][0] >= 1:
            break
        time.sleep(0.01)
    else:
        raise Failure('the slow payment never showed up as processing')
    d.call('POST', P, 409, 'duplicate while processing', tok, 'pay-slow', {'amount': 777})
    t.join(30)
    if t.is_alive():
        raise Failure('the slow payment never answered')

    # The check order, step by step (docs/idempotency.md, section 3.2).
    big = b'{"amount": 1, "pad": "' + b'x' * (70 * 1024) + b'"}'
    d.call('POST', P, 401, 'no credentials (even with a bad everything)', None, None, b'[',
           ctype='text/plain')
    d.call('POST', P, 401, 'wrong key', 'idem_000000000000_' + '0' * 40, 'k', {'amount': 1})
    d.call('POST', P, 401, 'not a bearer', None, 'k', {'amount': 1},
           headers={'Authorization': 'Basic dXNlcjpwYXNz'})
    d.call('POST', P, 413, 'over 64 KiB (Content-Length), bad type', tok, None, big,
           ctype='text/plain')
    d.call('POST', P, 413, 'over 64 KiB (chunked)', tok, 'pay-big', big, chunked=True)
    d.call('POST', P, 415, 'text/plain, no key', tok, None, {'amount': 1}, ctype='text/plain')
    d.call('POST', P, 415, 'application/jsonx', tok, 'k', {'amount': 1},
           ctype='application/jsonx')
    d.call('POST', P, 400, 'no key, body not JSON', tok, None, b'{not json')
    d.call('POST', P, 400, 'blank key', tok, '   ', {'amount': 1})
    d.call('POST', P, 400, 'key too long', tok, 'k' * 256, {'amount': 1})
    d.call('POST', P, 400, 'not JSON', tok, 'pay-400', b'{not json')
    d.call('POST', P, 400, 'an array', tok, 'pay-400', b'[1]')
    d.call('POST', P, 400, 'duplicate keys', tok, 'pay-400', b'{"amount":1,"amount":2}')
    d.call('POST', P, 400, 'too deep', tok, 'pay-400', b'{"a":' * 40 + b'1' + b'}' * 40)

    # --- POST /orders
    o1 = d.call('POST', O, 201, 'new order', tok, 'order-1', order)
    d.call('POST', O, 201, 'order replay', tok, 'order-1',
           {'items': [{'unit_price': '1000', 'quantity': 2, 'sku': 'A1'}], 'customer_id': 'c1'})
    d.call('POST', O, 201, 'same key as a payment: unrelated', tok, 'pay-new', order)
    d.call('POST', O, 422, 'order key reused', tok, 'order-1', dict(order, customer_id='c2'))
    for label, bad in [
        ('no items', {'customer_id': 'c1', 'items': []}),
        ('items missing', {'customer_id': 'c1'}),
        ('customer_id missing', {'items': order['items']}),
        ('quantity 0', {'customer_id': 'c1',
                        'items': [{'sku': 'A1', 'quantity': 0, 'unit_price': 1}]}),
        ('unit_price 1.5', {'customer_id': 'c1',
                            'items': [{'sku': 'A1', 'quantity': 1, 'unit_price': 1.5}]}),
        ('sku too long', {'customer_id': 'c1',
                          'items': [{'sku': 'S' * 65, 'quantity': 1, 'unit_price': 1}]}),
        ('item unknown field', {'customer_id': 'c1',
                                'items': [{'sku': 'A', 'quantity': 1, 'unit_price': 1,
                                           'x': 1}]}),
        ('item not an object', {'customer_id': 'c1', 'items': [1]}),
        ('101 items', {'customer_id': 'c1',
                       'items': [{'sku': 'A', 'quantity': 1, 'unit_price': 1}] * 101}),
    ]:
        d.call('POST', O, 422, label, tok, 'order-invalid', bad, reject=True)
    d.call('POST', O, 401, 'no credentials', None, 'order-x', order)
    d.call('POST', O, 413, 'over 64 KiB', tok, 'order-big', big)
    d.call('POST', O, 415, 'no JSON type', tok, 'order-x', order, ctype='text/plain')
    d.call('POST', O, 400, 'no key', tok, None, order)
    d.call('POST', O, 400, 'key with a control byte', tok, 'a\tb\x7f', order)
    d.call('POST', O, 400, 'scalar body', tok, 'order-x', b'42')

    # --- GET and HEAD of one resource
    pay_id = body_json(first)['id']
    for path in ('/payments/' + pay_id, '/payments/' + body_json(declined)['id'],
                 '/payments/' + body_json(pending)['id']):
        d.call('GET', path, 200, 'read a payment', tok)
    d.call('HEAD', '/payments/' + pay_id, 200, 'head a payment', tok)
    d.call('GET', '/payments/pay_doesnotexist', 404, 'no such payment', tok)
    d.call('GET', '/payments/' + pay_id, 404, "another tenant's payment", other)
    d.call('HEAD', '/payments/pay_doesnotexist', 404, 'head no such payment', tok)
    d.call('GET', '/payments/' + pay_id, 401, 'no credentials')
    d.call('HEAD', '/payments/' + pay_id, 401, 'head, no credentials')
    ord_id = body_json(o1)['id']
    d.call('GET', '/orders/' + ord_id, 200, 'read an order', tok)
    d.call('HEAD', '/orders/' + ord_id, 200, 'head an order', tok)
    d.call('GET', '/orders/ord_doesnotexist', 404, 'no such order', tok)
    d.call('GET', '/orders/' + ord_id, 404, "another tenant's order", other)
    d.call('HEAD', '/orders/' + ord_id, 404, "head another tenant's order", other)
    d.call('GET', '/orders/' + ord_id, 401, 'no credentials', 'idem_bad')
    d.call('HEAD', '/orders/' + ord_id, 401, 'head, no credentials')

    # --- POST /payments/{id}/refunds and GET /refunds/{id}
    paid = body_json(d.call('POST', P, 201, 'a payment to refund', tok, 'pay-refunds',
                            {'amount': 20000}))['id']
    R = '/payments/' + paid + '/refunds'
    r1 = d.call('POST', R, 201, 'refund', tok, 're-1', {'amount': 1000, 'reason': 'returned'})
    if not (r1['headers'].get('location') or '').startswith('/refunds/re_'):
        raise Failure('refund answered Location %r' % r1['headers'].get('location'))
    d.call('POST', R, 201, 'refund replay (other spelling)', tok, 're-1',
           {'reason': 'returned', 'amount': '1000'})
    d.call('POST', R, 201, 'refund, reason of 200 characters (400 bytes)', tok, 're-2',
           {'amount': 1, 'reason': '\u00e9' * 200})
    d.call('POST', R, 201, 'refund, reason null', tok, 're-3', {'amount': 2, 'reason': None})
    rd = d.call('POST', R, 402, 'refund declined', tok, 're-declined', {'amount': DECLINE})
    d.call('POST', R, 402, 'refund declined, replay', tok, 're-declined', {'amount': DECLINE})
    rp = d.call('POST', R, 202, 'refund outcome unknown', tok, 're-pending',
                {'amount': UNCERTAIN})
    d.call('POST', R, 202, 'refund outcome unknown, replay', tok, 're-pending',
           {'amount': UNCERTAIN})
    d.call('POST', R, 503, 'refund, provider unreachable', tok, 're-unavailable',
           {'amount': UNAVAILABLE})
    d.call('POST', R, 503, 'refund, provider unreachable, runs again', tok, 're-unavailable',
           {'amount': UNAVAILABLE})
    d.call('POST', R, 422, 'refund key reused with another amount', tok, 're-1',
           {'amount': 500, 'reason': 'returned'})
    d.call('POST', '/payments/' + pay_id + '/refunds', 422,
           'refund key reused for another payment', tok, 're-1',
           {'amount': 1000, 'reason': 'returned'})
    for label, bad in [
        ('refund amount 0', {'amount': 0}),
        ('refund amount -5', {'amount': -5}),
        ('refund amount 1.5', {'amount': 1.5}),
        ('refund amount a bool', {'amount': True}),
        ('refund reason a number', {'reason': 7}),
        ('refund reason of 201 characters', {'reason': 'r' * 201}),
        ('refund unknown field', {'amount': 1, 'currency': 'BRL'}),
    ]:
        d.call('POST', R, 422, label, tok, 're-invalid', bad, reject=True)
    d.call('POST', R, 409, 'refund exceeds', tok, 're-exceeds', {'amount': 20000})
    d.call('POST', R, 409, 'refund exceeds, key still free', tok, 're-exceeds',
           {'amount': 20000})
    d.call('POST', '/payments/' + body_json(declined)['id'] + '/refunds', 409,
           'refund of a declined payment', tok, 're-not-refundable', {})
    d.call('POST', '/payments/pay_doesnotexist/refunds', 404, 'refund of no such payment',
           tok, 're-404', {'amount': 1})
    d.call('POST', R, 404, "refund of another tenant's payment", other, 're-404',
           {'amount': 1})
    d.call('POST', R, 201, 'refund of all that is left', tok, 're-invalid', {})
    d.call('POST', R, 409, 'refund of a fully refunded payment', tok, 're-after', {})
    d.call('POST', R, 401, 'refund, no credentials', None, 're-x', {'amount': 1})
    d.call('POST', R, 413, 'refund, over 64 KiB', tok, 're-big', big)
    d.call('POST', R, 415, 'refund, no JSON type', tok, 're-x', {'amount': 1},
           ctype='text/plain')
    d.call('POST', R, 400, 'refund, no key', tok, None, {'amount': 1})
    d.call('POST', R, 400, 'refund, body not an object', tok, 're-x', b'[]')
    d.call('GET', '/payments/' + paid, 200, 'read a refunded payment', tok)
    ref_id = body_json(r1)['id']
    for ex in (r1, rd, rp):
        d.call('GET', '/refunds/' + body_json(ex)['id'], 200, 'read a refund', tok)
    d.call('HEAD', '/refunds/' + ref_id, 200, 'head a refund', tok)
    d.call('GET', '/refunds/re_doesnotexist', 404, 'no such refund', tok)
    d.call('GET', '/refunds/' + ref_id, 404, "another tenant's refund", other)
    d.call('HEAD', '/refunds/' + ref_id, 404, "head another tenant's refund", other)
    d.call('GET', '/refunds/' + ref_id, 401, 'no credentials')
    d.call('HEAD', '/refunds/' + ref_id, 401, 'head, no credentials')

    # 409: a duplicate refund while the first (slow provider) is processing.
    pay2 = body_json(d.call('POST', P, 201, 'a payment to refund slowly', tok, 'pay-refund-slow',
                            {'amount': 5000}))['id']
    t = threading.Thread(target=lambda: slow.update(
        ex=d.call('POST', '/payments/' + pay2 + '/refunds', 201, 'slow refund', tok,
                  're-slow', {'amount': 777})))
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = server.sql("SELECT count(*) FROM idempotency_records WHERE key = 're-slow' "
                          "AND state = 'processing'")
        if rows[0][0] >= 1:
            break
        time.sleep(0.01)
    else:
        raise Failure('the slow refund never showed up as processing')
    d.call('POST', '/payments/' + pay2 + '/refunds', 409, 'refund duplicate while processing',
           tok, 're-slow', {'amount': 777})
    t.join(30)
    if t.is_alive():
        raise Failure('the slow refund never answered')

    # --- PUT /orders/{id} and POST /orders/{id}/cancel: no key, by design
    U = '/orders/ord_client-1_A'
    C = U + '/cancel'
    put1 = d.call('PUT', U, 201, 'put a new order', tok, None, order)
    if put1['headers'].get('location') != U:
        raise Failure('PUT answered Location %r' % put1['headers'].get('location'))
    d.call('PUT', U, 200, 'put it again, spelled otherwise', tok, None,
           {'items': [{'unit_price': '1000', 'quantity': 2, 'sku': 'A1'}], 'customer_id': 'c1'})
    d.call('PUT', U, 200, 'put with an Idempotency-Key: ignored', tok, 'any key', order)
    d.call('PUT', U, 409, 'put another order under the id', tok, None,
           dict(order, customer_id='c2'))
    d.call('PUT', U, 201, "another tenant's order of the same id", other, None,
           dict(order, customer_id='c3'))
    d.call('PUT', '/orders/' + ord_id, 200, 'put over an order POST made', tok, None, order)
    d.call('PUT', '/orders/ord_' + 'z' * 64, 201, 'the longest id', tok, None, order)
    for label, path in [('id without ord_', '/orders/client-1'), ('id ord_ alone', '/orders/ord_'),
                        ('id with a dot', '/orders/ord_a.b'),
                        ('id too long', '/orders/ord_' + 'z' * 65)]:
        d.call('PUT', path, 400, label, tok, None, order)
    d.call('PUT', U, 400, 'put, not JSON', tok, None, b'{not json')
    for label, bad in [
        ('put, no items', {'customer_id': 'c1', 'items': []}),
        ('put, quantity 0', {'customer_id': 'c1',
                             'items': [{'sku': 'A1', 'quantity': 0, 'unit_price': 1}]}),
        ('put, the id in the body', dict(order, id='ord_client-1_A')),
    ]:
        d.call('PUT', U, 422, label, tok, None, bad, reject=True)
    d.call('PUT', U, 401, 'put, no credentials', None, None, order)
    d.call('PUT', U, 413, 'put, over 64 KiB', tok, None, big)
    d.call('PUT', U, 415, 'put, no JSON type', tok, None, order, ctype='text/plain')

    d.call('POST', C, 200, 'cancel', tok, None, b'')
    d.call('POST', C, 200, 'cancel again, {}', tok, None, {})
    d.call('POST', C, 200, 'cancel with an Idempotency-Key: ignored', tok, 'k', b'')
    d.call('GET', U, 200, 'read a cancelled order', tok)
    d.call('PUT', U, 200, 'put the command of a cancelled order', tok, None, order)
    d.call('POST', '/orders/ord_nosuchorder/cancel', 404, 'cancel no such order', tok, None, b'')
    d.call('POST', '/orders/' + ord_id + '/cancel', 404, "cancel another tenant's order",
           other, None, b'')
    d.call('POST', '/orders/bad.id/cancel', 404, 'cancel an id no order has', tok, None, b'')
    d.call('POST', C, 401, 'cancel, no credentials', None, None, b'')
    d.call('POST', C, 400, 'cancel, body not an object', tok, None, b'[]')
    d.call('POST', C, 422, 'cancel with a field', tok, None, {'reason': 'x'}, reject=True)
    d.call('POST', C, 413, 'cancel, over 64 KiB', tok, None, big)
    d.call('POST', C, 415, 'cancel, no JSON type', tok, None, b'', ctype='text/plain')

    # --- /healthz and /metrics, no credentials needed
    d.call('GET', '/healthz', 200, 'healthz')
    d.call('HEAD', '/healthz', 200, 'head healthz')
    d.call('GET', '/healthz', 200, 'healthz with any credentials', 'whatever')
    d.call('GET', '/readyz', 200, 'readyz')
    d.call('HEAD', '/readyz', 200, 'head readyz')
    m = d.call('GET', '/metrics', 200, 'metrics')
    d.call('HEAD', '/metrics', 200, 'head metrics')
    text = m['body'].decode('utf-8', 'replace')
    for name in ('idem_requests_total{operation="create_payment",outcome="new"}',
                 'idem_records_pending 2', 'idem_request_duration_seconds_bucket'):
        if name not in text:
            raise Failure('/metrics lacks %r' % name)

    # --- POST /webhooks/provider: the provider's events, signed
    drive_webhooks(d, body_json(pending)['id'])

    # --- unmatched: unknown paths (before credentials) and methods
    for path in ('/nowhere', '/payments/', '/payments/has-dash', '/orders/a/b', '/Payments',
                 '/payments/' + 'x' * 64, '/orders/x/cancel/y', '/orders/' + 'x' * 96,
                 '/orders//cancel', '/refunds/', '/refunds/re-x', '/payments/x/refunds/y',
                 '/payments//refunds'):
        d.call('GET', path, 404, 'unknown path')
    d.call('POST', '/nowhere', 404, 'unknown path, POST', tok, 'k', {'amount': 1})
    for method, path in (('GET', P), ('HEAD', P), ('PUT', O), ('DELETE', '/payments/' + pay_id),
                         ('POST', '/payments/' + pay_id), ('POST', '/healthz'),
                         ('PATCH', '/metrics'), ('OPTIONS', O), ('DELETE', '/orders/x'),
                         ('GET', '/orders/x/cancel'), ('PUT', '/orders/x/cancel'),
                         ('GET', '/payments/x/refunds'), ('POST', '/refunds/x'),
                         ('DELETE', '/refunds/x'), ('GET', '/webhooks/provider'),
                         ('PUT', '/webhooks/provider')):
        d.call(method, path, 405, 'method not allowed')

    # --- request line and headers over --max-header-bytes: 431, any route
    pad = {'X-Pad': 'p' * (20 * 1024)}
    for method, path, t in (('POST', P, tok), ('POST', O, tok), ('GET', '/payments/' + pay_id, tok),
                            ('HEAD', '/payments/' + pay_id, tok),
                            ('GET', '/orders/' + ord_id, tok), ('HEAD', '/orders/' + ord_id, tok),
                            ('POST', R, tok), ('GET', '/refunds/' + ref_id, tok),
                            ('HEAD', '/refunds/' + ref_id, tok),
                            ('GET', '/healthz', None), ('HEAD', '/healthz', None),
                            ('GET', '/readyz', None), ('HEAD', '/readyz', None),
                            ('GET', '/metrics', None), ('HEAD', '/metrics', None),
                            ('POST', '/webhooks/provider', None),
                            ('GET', '/nowhere', None)):
        # No body: idemd hangs up after the 431, and a body still being sent
        # would meet a closed socket.
        d.call(method, path, 431, 'headers over --max-header-bytes', t, 'k-431', None,
               headers=pad)

    # --- the store fails: 503 everywhere it is needed; /metrics still answers
    server.store_fault(True)
    try:
        d.call('POST', P, 503, 'store failure', tok, 'pay-store', {'amount': 1})
        d.call('POST', O, 503, 'store failure', tok, 'order-store', order)
        d.call('GET', '/payments/' + pay_id, 503, 'store failure', tok)
        d.call('HEAD', '/payments/' + pay_id, 503, 'store failure', tok)
        d.call('GET', '/orders/' + ord_id, 503, 'store failure', tok)
        d.call('HEAD', '/orders/' + ord_id, 503, 'store failure', tok)
        d.call('PUT', '/orders/ord_store', 503, 'store failure', tok, None, order)
        d.call('POST', R, 503, 'store failure', tok, 're-store', {'amount': 1})
        d.call('GET', '/refunds/' + ref_id, 503, 'store failure', tok)
        d.call('HEAD', '/refunds/' + ref_id, 503, 'store failure', tok)
        d.call('POST', '/orders/' + ord_id + '/cancel', 503, 'store failure', tok, None, b'')
        d.call('GET', '/healthz', 503, 'store unreachable')
        d.call('HEAD', '/healthz', 503, 'store unreachable')
        d.call('GET', '/readyz', 503, 'store failure')
        d.call('HEAD', '/readyz', 503, 'store failure')
        webhook(d, 503, 'store failure', event('evt_store', 'charge.succeeded', 'pay_x', 1))
        d.call('GET', '/metrics', 200, 'metrics while the store fails')
    finally:
        server.store_fault(False)
    d.call('GET', '/healthz', 200, 'store back')
    d.call('GET', '/payments/' + pay_id, 200, 'store back', tok)
    d.call('POST', P, 201, 'a key tried during the fault is free', tok, 'pay-store',
           {'amount': 1})


def event(ev_id, ev_type, key, amount):
    return json.dumps({'id': ev_id, 'type': ev_type, 'created': int(time.time()),
                       'data': {'key': key, 'id': 'ch_openapi', 'amount': amount}}).encode()


def signature(body, t=None, secret=WEBHOOK_SECRET):
    t = int(time.time()) if t is None else t
    mac = hmac.new(secret.encode(), b'%d.' % t + body, hashlib.sha256).hexdigest()
    return 't=%d,v1=%s' % (t, mac)


def webhook(d, expect, label, body, sig=None, signed=True):
    headers = {}
    if signed:
        headers['Idem-Psp-Signature'] = sig if sig is not None else signature(body)
    return d.call('POST', '/webhooks/provider', expect, label, None, None, body,
                  headers=headers)


def drive_webhooks(d, pending_id):
    """The provider's events: the pending payment settled once, then every
    refusal; nothing asks for credentials."""
    ev = event('evt_openapi_1', 'charge.succeeded', pending_id, UNCERTAIN)
    ok = webhook(d, 200, 'event applied', ev)
    if body_json(ok) != {'status': 'applied'}:
        raise Failure('the event was not applied: %r' % ok['body'])
    webhook(d, 200, 'event again: duplicate', ev)
    webhook(d, 200, 'event for a settled payment: ignored',
            event('evt_openapi_2', 'charge.declined', pending_id, UNCERTAIN))
    webhook(d, 200, 'event for no payment: ignored',
            event('evt_openapi_3', 'charge.succeeded', 'pay_unknown', 1))
    bad = event('evt_openapi_4', 'charge.succeeded', pending_id, UNCERTAIN)
    webhook(d, 400, 'event unsigned', bad, signed=False)
    webhook(d, 400, 'event signature malformed', bad, sig='v1=00')
    webhook(d, 400, 'event forged', bad, sig=signature(bad, secret='another'))
    webhook(d, 400, 'event stale', bad, sig=signature(bad, t=int(time.time()) - 301))
    webhook(d, 400, 'event not JSON', b'{"id":')
    webhook(d, 400, 'event of an unknown type', event('evt_openapi_5', 'charge.refunded',
                                                      pending_id, UNCERTAIN))
    webhook(d, 413, 'event over 8 KiB', bad + b' ' * 9000)
    if d.s.sql("SELECT count(*) FROM processed_events")[0][0] != 1:
        raise Failure('a refused or duplicate event was recorded')


def drive_connection_cap(d, tok):
    """A second idemd with --max-connections 1 and one connection held
    open: every request on another connection is answered 503 first."""
    hold = socket.create_connection(('127.0.0.1', d.s.port), timeout=10)
    try:
        time.sleep(0.2)  # let idemd count the held connection
        for method, path, t, body in (
                ('POST', '/payments', tok, {'amount': 1}),
                ('POST', '/orders', tok, {'customer_id': 'c'}),
                ('GET', '/payments/pay_x', tok, None), ('HEAD', '/payments/pay_x', tok, None),
                ('GET', '/orders/ord_x', tok, None), ('HEAD', '/orders/ord_x', tok, None),
                ('POST', '/payments/pay_x/refunds', tok, {'amount': 1}),
                ('GET', '/refunds/re_x', tok, None), ('HEAD', '/refunds/re_x', tok, None),
                ('GET', '/healthz', None, None), ('HEAD', '/healthz', None, None),
                ('GET', '/readyz', None, None), ('HEAD', '/readyz', None, None),
                ('GET', '/metrics', None, None), ('HEAD', '/metrics', None, None),
                ('GET', '/nowhere', None, None), ('DELETE', '/payments', None, None),
                ('POST', '/webhooks/provider', None, {'id': 'evt_cap'})):
            d.call(method, path, 503, 'beyond --max-connections', t, 'k-cap', body)
    finally:
        hold.close()
    # This idemd has no --provider-webhook-secret: no such route. (Its one
    # connection is free again once idemd has seen the other close.)
    for _ in range(50):
        ex = d.call('POST', '/webhooks/provider', None, 'without a webhook secret', None, None,
                    event('evt_none', 'charge.succeeded', 'pay_x', 1))
        if ex['status'] != 503:
            break
        time.sleep(0.1)
    if ex['status'] != 404:
        raise Failure('POST /webhooks/provider without a secret answered %s' % ex['status'])


# ---------------------------------------------------------------------------
# The checker checks itself


def mutations(doc):
    """(what, broken copy of doc) pairs; each must be rejected."""
    def m(what, fn):
        c = copy.deepcopy(doc)
        fn(c)
        return what, c
    paths = lambda c: c['paths']
    schemas = lambda c: c['components']['schemas']
    return [
        m('402 removed from POST /payments',
          lambda c: paths(c)['/payments']['post']['responses'].pop('402')),
        m('503 removed from GET /healthz',
          lambda c: paths(c)['/healthz']['get']['responses'].pop('503')),
        m('503 removed from HEAD /metrics',
          lambda c: paths(c)['/metrics']['head']['responses'].pop('503')),
        m('431 not documented', lambda c: c['x-transport-responses'].pop('431')),
        m('transport answers documented as JSON',
          lambda c: c['x-transport-responses']['431'].update(
              {'content': {'application/json': {'schema': {'type': 'object'}}}})),
        m('unmatched 503 not documented', lambda c: c['x-unmatched-responses'].pop('503')),
        m('path /orders/{id} removed', lambda c: paths(c).pop('/orders/{id}')),
        m('path /orders/{id}/cancel removed', lambda c: paths(c).pop('/orders/{id}/cancel')),
        m('PUT of /orders/{id} removed', lambda c: paths(c)['/orders/{id}'].pop('put')),
        m('409 removed from PUT /orders/{id}',
          lambda c: paths(c)['/orders/{id}']['put']['responses'].pop('409')),
        m('a cancelled order documented without cancelled_at',
          lambda c: schemas(c)['OrderResource']['properties'].pop('cancelled_at')),
        m('cancel documented as answering a created order',
          lambda c: schemas(c)['CancelledOrder']['allOf'][1].update(
              {'properties': {'status': {'const': 'created'}}})),
        m('order id pattern without the dash',
          lambda c: c['components']['headers']['OrderLocation']['schema'].update(
              {'pattern': '^/orders/ord_[A-Za-z0-9_]+$'})),
        m('HEAD of /metrics removed', lambda c: paths(c)['/metrics'].pop('head')),
        m('a status never produced documented',
          lambda c: paths(c)['/healthz']['get']['responses'].update(
              {'418': {'description': 'teapot'}})),
        m('payment with a required field the server does not send',
          lambda c: schemas(c)['PaymentAnswer']['required'].append('fee')),
        m('order status renamed',
          lambda c: schemas(c)['Order']['properties'].update({'status': {'const': 'open'}})),
        m('error body may not have "error"',
          lambda c: schemas(c)['Error'].update({'required': ['message']})),
        m('Location pattern changed',
          lambda c: c['components']['headers']['PaymentLocation']['schema'].update(
              {'pattern': '^/charges/'})),
        m('a required header the server does not send',
          lambda c: c['components']['responses']['Unauthorized']['headers'].update(
              {'X-Trace': {'required': True, 'schema': {'type': 'string'}}})),
        m('Retry-After must be at least 5',
          lambda c: c['components']['headers']['RetryAfter']['schema'].update({'minimum': 5})),
        m('metrics documented as JSON',
          lambda c: paths(c)['/metrics']['get']['responses']['200'].update(
              {'content': {'application/json': {'schema': {'type': 'object'}}}})),
        m('/metrics documented as needing credentials',
          lambda c: paths(c)['/metrics']['get'].pop('security')),
        m('POST /payments documented without security',
          lambda c: paths(c)['/payments']['post'].update({'security': []})),
        m('request amount at most 100',
          lambda c: schemas(c)['PositiveInteger']['oneOf'][0].update({'maximum': 100})),
        m('request accepts unknown fields',
          lambda c: schemas(c)['PaymentRequest'].update({'additionalProperties': True})),
        m('405 not documented', lambda c: c['x-unmatched-responses'].pop('405')),
        m('Allow values changed',
          lambda c: c['components']['headers']['Allow']['schema'].update({'enum': ['POST']})),
        m('GET documented for /payments',
          lambda c: paths(c)['/payments'].update({'get': copy.deepcopy(
              paths(c)['/payments/{id}']['get'])})),
        m('path /payments/{id}/refunds removed',
          lambda c: paths(c).pop('/payments/{id}/refunds')),
        m('path /refunds/{id} removed', lambda c: paths(c).pop('/refunds/{id}')),
        m('402 removed from POST /payments/{id}/refunds',
          lambda c: paths(c)['/payments/{id}/refunds']['post']['responses'].pop('402')),
        m('409 removed from POST /payments/{id}/refunds',
          lambda c: paths(c)['/payments/{id}/refunds']['post']['responses'].pop('409')),
        m('404 removed from POST /payments/{id}/refunds',
          lambda c: paths(c)['/payments/{id}/refunds']['post']['responses'].pop('404')),
        m('refund without payment_id',
          lambda c: schemas(c)['Refund']['properties'].pop('payment_id')),
        m('refund reason documented as a string, never null',
          lambda c: schemas(c)['Refund']['properties'].update(
              {'reason': {'type': 'string'}})),
        m('declined refund documented with the payment\'s error',
          lambda c: schemas(c)['RefundDeclined']['allOf'][1]['properties'].update(
              {'error': {'const': 'the payment was declined'}})),
        m('refund reason allowed 300 characters',
          lambda c: schemas(c)['RefundRequest']['properties']['reason'].update(
              {'maxLength': 300})),
        m('refund request accepts unknown fields',
          lambda c: schemas(c)['RefundRequest'].update({'additionalProperties': True})),
        m('payment without amount_refunded',
          lambda c: schemas(c)['Payment']['properties'].pop('amount_refunded')),
        m('refund Location pattern changed',
          lambda c: c['components']['headers']['RefundLocation']['schema'].update(
              {'pattern': '^/payments/'})),
        m('payment id pattern narrowed',
          lambda c: c['components']['parameters']['PaymentId']['schema'].update(
              {'pattern': '^pay_[0-9]+$'})),
    ]


# ---------------------------------------------------------------------------


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    idemd = argv[1]
    doc_path = argv[2] if len(argv) > 2 else DEFAULT_DOC
    try:
        doc = load_doc(doc_path)
    except Failure as e:
        print('check_openapi: FAIL: %s' % e)
        return 1

    servers = []
    server = Server(idemd, [
        '--sandbox-decline-amount', str(DECLINE),
        '--sandbox-uncertain-amount', str(UNCERTAIN),
        '--sandbox-unavailable-amount', str(UNAVAILABLE),
        '--sandbox-delay', SANDBOX_DELAY,
        '--inflight-wait', INFLIGHT_WAIT,
        '--reconcile-interval', '1h',   # pending stays pending
        '--max-header-bytes', '16384',
        '--provider-webhook-secret', WEBHOOK_SECRET,
    ])
    servers.append(server)
    ok = False
    try:
        tok = server.cli('tenant', 'create', 'api').strip()
        other = server.cli('tenant', 'create', 'other').strip()
        server.start()
        d = Driver(server)
        drive(d, tok, other, server)
        stop_clean(server)

        capped = Server(idemd, ['--max-connections', '1'])
        servers.append(capped)
        ctok = capped.cli('tenant', 'create', 'api').strip()
        capped.start()
        drive_connection_cap(Driver(capped, d.exchanges), ctok)
        stop_clean(capped)

        problems = check_all(doc, d.exchanges)
        produced = sorted({(e['method'], str(e['status'])) for e in d.exchanges})
        print('check_openapi: %d answers checked against %s' % (len(d.exchanges), doc_path))
        print('check_openapi: produced ' + ', '.join('%s %s' % p for p in produced))
        if problems:
            print('check_openapi: FAIL, %d problem(s):' % len(problems))
            for p in problems:
                print('  - ' + p)
            return 1

        # The checker must reject broken documents on the same answers.
        blind = []
        broken_docs = mutations(doc)
        for what, broken in broken_docs:
            if not check_all(broken, d.exchanges):
                blind.append(what)
        if blind:
            print('check_openapi: FAIL, the checker did not notice: ' + '; '.join(blind))
            return 1
        print('check_openapi: self-test: each of %d broken copies of the document is '
              'rejected' % len(broken_docs))
        print('check_openapi: OK')
        ok = True
        return 0
    except Failure as e:
        print('check_openapi: FAIL: %s' % e)
        return 1
    finally:
        for srv in servers:
            try:
                srv.stop()
            except Failure:
                pass
            if ok or not os.environ.get('IDEM_TEST_KEEP'):
                shutil.rmtree(srv.dir, ignore_errors=True)
            else:
                print('check_openapi: kept %s' % srv.dir)


if __name__ == '__main__':
    sys.exit(main(sys.argv))
