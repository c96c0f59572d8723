"""Fingerprints of JSON bodies are RFC 8785 (JCS): our canonicalizer against the RFC's
published examples, and a real server (uvicorn, httpx) comparing re-encoded numbers as
numbers, while a record stored with the fingerprint of before JCS still replays."""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest

import idemlock
from idemlock.integrations.http.core import HttpCore
from idemlock.integrations.http.fingerprint import RequestView, fingerprint_of
from idemlock.integrations.http.jcs import canonical, loads, number
from idemlock.integrations.http.recorded_response import record_of

from .test_asgi import DEFAULTS, SPEC, replayed, running, starlette_app

# RFC 8785 Appendix B: IEEE 754 doubles (as hex) and their JCS text.
APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),  # minus zero
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),  # round to even
]


@pytest.mark.parametrize(("bits", "text"), APPENDIX_B)
def test_rfc8785_appendix_b_numbers(bits: str, text: str) -> None:
    value = struct.unpack(">d", bytes.fromhex(bits))[0]
    assert number(value) == text
    assert canonical(value) == text.encode()


@pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000", "fff0000000000000"])
def test_nan_and_infinities_have_no_jcs_form(bits: str) -> None:
    assert canonical([struct.unpack(">d", bytes.fromhex(bits))[0]]) is None


def test_rfc8785_section_3_2_2_example() -> None:
    # RFC 8785 section 3.2.2: input with numbers, escapes and literals, and its output.
    text = (
        '{\n  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],\n'
        '  "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",\n'
        '  "literals": [null, true, false]\n}'
    )
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical(loads(text)) == expected.encode("utf-8")


def test_rfc8785_section_3_2_3_member_order_is_by_utf16_code_units() -> None:
    # RFC 8785 section 3.2.3: the sorting example (an emoji's surrogates sort before
    # U+FB33, unlike code point order).
    text = (
        '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return", '
        '"\\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One", '
        '"\\ud83d\\ude00": "Emoji: Grinning Face", "\\u0080": "Control", '
        '"\\u00f6": "Latin Small Letter O With Diaeresis"}'
    )
    doc = loads(text)
    out = json.loads(canonical(doc) or b"")
    assert list(out.values()) == [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",
        "Hebrew Letter Dalet With Dagesh",
    ]
    assert sorted(doc) != list(out)  # Python's code point order would differ


def test_numbers_compare_as_numbers() -> None:
    forms = ['{"amount": 1200}', '{"amount": 1200.0}', '{"amount":1.2e3}', '{"amount":12E2}']
    assert {canonical(loads(f)) for f in forms} == {b'{"amount":1200}'}
    assert canonical(loads('{"amount": 1200.5}')) == b'{"amount":1200.5}'


def test_values_outside_i_json_have_no_form() -> None:
    assert canonical(loads('{"a": 1, "a": 2}')) is None  # a member given twice
    assert canonical(2**53 + 1) is None  # no double holds it
    assert canonical(2**60) == b"1152921504606847000"  # one does, printed as ECMAScript does
    assert canonical(loads('["\\ud800"]')) is None  # a lone surrogate
    assert canonical(loads("[NaN]")) is None
    assert canonical({"a": object()}) is None


# ---- through a real server ----------------------------------------------------------


def test_a_json_body_with_re_encoded_numbers_replays(tmp_path: Path) -> None:
    t, key = uuid.uuid4().hex, f"order-{uuid.uuid4().hex}"
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    with running(starlette_app, tmp_path / "db", **DEFAULTS) as srv, srv.client() as c:
        first = c.post("/charges", content=f'{{"tag":"{t}","amount":1200}}', headers=h)
        again = c.post("/charges", content=f'{{"amount": 1200.0, "tag": "{t}"}}', headers=h)
        exp = c.post("/charges", content=f'{{"amount":1.2e3,"tag":"{t}"}}', headers=h)
        other = c.post("/charges", content=f'{{"amount":1200.5,"tag":"{t}"}}', headers=h)
    assert first.status_code == 201 and not replayed(first)
    assert replayed(again) and again.content == first.content
    assert replayed(exp) and exp.content == first.content
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"
    assert srv.calls[t] == 1


def _old_fingerprint(body: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint idemlock stored before JCS, built by hand as it was then."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return {
        "method": "POST",
        "path": "/charges",
        "query": "",
        "headers": [["content-type", "application/json"]],
        "body": "json:" + hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


def test_a_record_stored_with_the_old_fingerprint_still_replays(tmp_path: Path) -> None:
    t, key = uuid.uuid4().hex, f"old-{uuid.uuid4().hex}"
    body = {"tag": t, "amount": 7.5, "note": "caf\u00e9"}
    recorded = b'{"recorded":"before the upgrade"}'
    with running(starlette_app, tmp_path / "db", **DEFAULTS) as srv:
        # The record a previous version wrote: its lookup key and its fingerprint.
        with idemlock.connect(srv.db) as coord:
            port = coord.idempotency(SPEC)
            claim = port.claim(HttpCore.lookup_key(None, key), payload=_old_fingerprint(body))
            assert isinstance(claim, idemlock.Claimed)
            headers = [(b"content-type", b"application/json")]
            port.complete(claim.token, record_of(201, headers, [recorded]))
        h = {"Idempotency-Key": f'"{key}"'}  # quoted: a client of that version
        with srv.client() as c:
            same = c.post("/charges", json=body, headers=h)
            spaced = c.post(
                "/charges",
                content=json.dumps(body, indent=2),
                headers={**h, "Content-Type": "application/json"},
            )
            changed = c.post("/charges", json={**body, "amount": 8}, headers=h)
    assert same.status_code == 201 and replayed(same) and same.content == recorded
    assert replayed(spaced) and spaced.content == recorded
    assert changed.status_code == 422
    assert srv.calls[t] == 0


def test_a_json_record_stored_by_0_1_0_still_replays(tmp_path: Path) -> None:
    # 0.1.0 fingerprinted every body by its bytes (the bare hex SHA-256). The same
    # request retried after the upgrade matches neither the JCS form nor the unreleased
    # json: form, but is compared in 0.1.0's form too: replayed, not run, not a 422.
    t, key = uuid.uuid4().hex, f"v010-{uuid.uuid4().hex}"
    raw = json.dumps({"tag": t, "amount": 1200}).encode()
    fingerprint = {**_old_fingerprint({}), "body": hashlib.sha256(raw).hexdigest()}
    with running(starlette_app, tmp_path / "db", **DEFAULTS) as srv:
        with idemlock.connect(srv.db) as coord:
            port = coord.idempotency(SPEC)
            claim = port.claim(HttpCore.lookup_key(None, key), payload=fingerprint)
            assert isinstance(claim, idemlock.Claimed)
            headers = [(b"content-type", b"application/json")]
            port.complete(claim.token, record_of(201, headers, [b'{"recorded":"0.1.0"}']))
        h = {"Idempotency-Key": f'"{key}"', "Content-Type": "application/json"}
        with srv.client() as c:
            retry = c.post("/charges", content=raw, headers=h)
            # Other bytes of the same document: 0.1.0 would have refused it, and so do
            # its form and the json: form here (only the current form is by meaning).
            respaced = c.post("/charges", content=raw.replace(b", ", b",  "), headers=h)
            other = c.post("/charges", content=raw.replace(b"1200", b"1300"), headers=h)
    assert retry.status_code == 201 and retry.json() == {"recorded": "0.1.0"}
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert respaced.status_code == 422 and other.status_code == 422
    assert srv.calls[t] == 0


def test_the_body_digest_is_sha256_of_the_jcs_bytes() -> None:
    # What a client in another language computes: "jcs:" + hex SHA-256(JCS(body)).
    view = RequestView(
        "POST", "/charges", "", [("content-type", "application/json")], b'{"b":[1.0,2],"a":"x"}'
    )
    fp = fingerprint_of(view, frozenset({"content-type"}), None)
    jcs = b'{"a":"x","b":[1,2]}'
    assert fp["body"] == "jcs:" + hashlib.sha256(jcs).hexdigest()
