"""Tests that Django's own test runner runs (``python manage.py test
tests.django_app.runner_checks``), started by tests/test_django.py::
test_the_app_under_djangos_own_test_runner. Named so that pytest does not collect it:
the runner, not pytest, sets Django up, runs the system checks first and makes the test
database. The store is the SQLite file of ``$DJANGO_TEST_STORE``."""

from __future__ import annotations

import io
import json
import os
import uuid

from django.core.management import call_command
from django.test import TestCase

import idemlock


class IdemlockUnderDjangosRunner(TestCase):
    def test_manage_py_check_passes_even_at_warning_level(self) -> None:
        out = io.StringIO()
        call_command("check", "--fail-level", "WARNING", stdout=out)
        self.assertIn("no issues", out.getvalue())

    def test_the_middleware_replays_a_retry(self) -> None:
        tag = uuid.uuid4().hex
        headers = {"Idempotency-Key": f'"{uuid.uuid4().hex}"', "X-User": "alice"}
        sent = [
            self.client.post(
                "/mw/charges", {"tag": tag}, content_type="application/json", headers=headers
            )
            for _ in range(2)
        ]
        self.assertEqual([r.status_code for r in sent], [201, 201])
        self.assertNotIn("Idempotent-Replayed", sent[0])
        self.assertEqual(sent[1]["Idempotent-Replayed"], "true")
        self.assertEqual(sent[1].content, sent[0].content)

    def test_manage_py_idemlock_keys_locks_and_purge(self) -> None:
        key = uuid.uuid4().hex
        headers = {"Idempotency-Key": f'"{key}"', "X-User": "bob"}
        body = {"tag": uuid.uuid4().hex}
        self.client.post("/mw/charges", body, content_type="application/json", headers=headers)
        out = io.StringIO()
        call_command("idemlock", "keys", "--spec", "http", "--json", stdout=out)
        self.assertIn("completed", {r["state"] for r in json.loads(out.getvalue())})
        with idemlock.connect(os.environ["DJANGO_TEST_STORE"]) as coord:
            lease = coord.lock(idemlock.LockSpec("runner-nightly", ttl=60)).acquire("report")
            assert lease is not None
            out = io.StringIO()
            call_command("idemlock", "locks", "--json", stdout=out)
            held = [(r["spec"], r["key"]) for r in json.loads(out.getvalue())]
            self.assertIn(("runner-nightly", "report"), held)
            coord.lock(idemlock.LockSpec("runner-nightly", ttl=60)).release(lease)
        out = io.StringIO()
        call_command("idemlock", "purge", stdout=out)
        self.assertTrue(out.getvalue().strip())
