#!/usr/bin/env python3
"""Time from a payment's 202 (its outcome unknown) to a settled record,
with the provider's webhooks and with the reconciler alone
(docs/payments.md, "Webhooks"). idemd on SQLite with idem-psp as its
provider, which charges and then drops every answer (--drop-after); with
webhooks, idem-psp sends its signed events to idemd's
POST /webhooks/provider. One payment at a time: POST, then GET every
millisecond until it is no longer pending. Prints figures; never passes
or fails on them.

Usage: bench/settle_latency.py [PAYMENTS] [BUILD_DIR]   (defaults 30, build)
"""
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 30
BUILD = sys.argv[2] if len(sys.argv) > 2 else os.path.join(REPO, 'build')
IDEMD = os.path.join(BUILD, 'idemd')
PSP = os.path.join(BUILD, 'tools', 'psp', 'idem-psp')
SECRET = 'bench-secret'


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def wait_up(port):
    for _ in range(300):
        try:
            c = http.client.HTTPConnection('127.0.0.1', port, timeout=1)
            c.request('GET', '/healthz')
            c.getresponse().read()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f'nothing answers on port {port}')


def run(webhooks, run_dir):
    idemd_port, psp_port = free_port(), free_port()
    db = os.path.join(run_dir, 'idem.db')
    psp_flags = ['--drop-after']
    if webhooks:
        psp_flags += ['--webhook-url', f'http://127.0.0.1:{idemd_port}/webhooks/provider',
                      '--webhook-secret', SECRET]
    procs = []
    try:
        procs.append(subprocess.Popen(
            [IDEMD, 'serve', '--listen', f'127.0.0.1:{idemd_port}', '--db', db,
             '--provider', f'http://127.0.0.1:{psp_port}',
             '--provider-webhook-secret', SECRET], stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(
            [PSP, '--listen', f'127.0.0.1:{psp_port}', '--db',
             os.path.join(run_dir, 'psp.db')] + psp_flags, stderr=subprocess.DEVNULL))
        wait_up(psp_port)
        wait_up(idemd_port)
        token = subprocess.check_output([IDEMD, 'tenant', 'create', 'bench', '--db', db],
                                        text=True).strip()
        c = http.client.HTTPConnection('127.0.0.1', idemd_port)
        auth = {'Authorization': f'Bearer {token}', 'Content-Type': 'application/json'}
        settled = []
        for i in range(N):
            c.request('POST', '/payments', body=json.dumps({'amount': 1000 + i}),
                      headers=dict(auth, **{'Idempotency-Key': f'settle-{i}'}))
            r = c.getresponse()
            pay = json.loads(r.read())
            if r.status != 202:
                sys.exit(f'expected 202, got {r.status}: {pay}')
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:
                c.request('GET', f"/payments/{pay['id']}", headers=auth)
                r = c.getresponse()
                if json.loads(r.read())['status'] != 'pending':
                    settled.append((time.monotonic() - t0) * 1000)
                    break
                time.sleep(0.001)
        settled.sort()
        print(f"{'webhooks and reconciler' if webhooks else 'reconciler alone':24} "
              f"{len(settled)}/{N} settled; 202 -> settled: median {statistics.median(settled):.1f} ms, "
              f"max {settled[-1]:.1f} ms", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait()


for webhooks in (True, False):
    d = tempfile.mkdtemp(prefix='idem-settle.')
    try:
        run(webhooks, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
