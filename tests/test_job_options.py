"""One ``JobOptions`` checks the options of every queue's idempotent job (issue 22): the
same option refused the same way by RQ's and Dramatiq's decorators and Celery's task
(arq's decorator is the same call, tested in tests/test_arq.py's session). No store,
no broker: the options are checked when the job is made."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from idemlock import ConfigurationError, IdempotencySpec, SemaphoreSpec
from idemlock.integrations import celery as idem_celery
from idemlock.integrations import dramatiq as idem_dramatiq
from idemlock.integrations import rq as idem_rq
from idemlock.integrations.jobs.options import JobOptions

DECORATORS: dict[str, Callable[..., Any]] = {
    "rq": idem_rq.idempotent_job,
    "dramatiq": idem_dramatiq.idempotent,
}


@pytest.mark.parametrize("queue", sorted(DECORATORS))
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"retry_every": 0},
            "retry_every must be a positive number of seconds or a timedelta, up to the "
            "maximum of 100 years (idemlock.MAX_TTL), got 0",
        ),
        ({"store_retry_max": True}, "store_retry_max must be a positive number of seconds"),
        ({"store_retry_backoff": "1s"}, "store_retry_backoff must be a positive number of seconds"),
        ({"renew_every": -1}, "renew_every must be zero or a positive number of seconds"),
        ({"retry_evry": 5}, "unknown option(s) retry_evry; the options are spec, key"),
        ({"key": "order"}, "key must be a callable of the job's arguments or None"),
        ({"spec": 3}, "spec must be an IdempotencySpec or a name, got 3"),
        ({"concurrency": 0}, "concurrency must be None or an int from 1 to 10000"),
        ({"concurrency": 10_001}, "concurrency must be None or an int from 1 to 10000"),
        ({"concurrency": 2.0}, "the most jobs of one concurrency key running at once), got 2.0"),
        ({"concurrency": True}, "concurrency must be None or an int from 1 to 10000"),
        ({"concurrency": 2, "concurrency_key": "tenant"}, "concurrency_key must be a callable"),
        ({"concurrency_key": lambda t: t}, "concurrency_key needs concurrency (the most jobs"),
        ({"concurrency": 2, "concurrency_wait": -1}, "concurrency_wait must be zero or a"),
    ],
)
def test_every_queue_refuses_a_bad_option_the_same_way(
    queue: str, options: dict[str, Any], message: str
) -> None:
    options = dict(options)  # the parameters are shared by both queues' runs
    spec = options.pop("spec", "charge")
    with pytest.raises(ConfigurationError) as info:
        DECORATORS[queue](spec, **options)
    assert message in str(info.value)
    assert str(info.value).startswith("@idempotent")  # names the decorator


def test_celery_task_options_are_checked_by_the_same_job_options() -> None:
    with pytest.raises(ConfigurationError) as info:

        class Slow(idem_celery.IdempotentTask):
            name = "slow"
            idemlock_spec = "charge"
            idemlock_store_retry_max = 0

            def run(self) -> None: ...

    assert str(info.value) == (
        "task slow: idemlock_store_retry_max must be a positive number of seconds or a "
        "timedelta, up to the maximum of 100 years (idemlock.MAX_TTL), got 0"
    )

    class Checked(idem_celery.IdempotentTask):
        name = "checked"
        idemlock_spec = "charge"
        idemlock_retry_every = timedelta(seconds=2)

        def run(self) -> None: ...

    assert Checked._idemlock_options.retry_every == 2.0
    assert Checked._idemlock_options.send_lease == 600.0

    # A subclass of a concrete task is checked again, with its own options.
    with pytest.raises(ConfigurationError, match="task Sub: idemlock_retry_every"):

        class Sub(Checked):
            idemlock_retry_every = -1


def test_celery_concurrency_options_are_checked_when_the_task_is_made() -> None:
    with pytest.raises(ConfigurationError) as info:

        class Crowded(idem_celery.IdempotentTask):
            name = "crowded"
            idemlock_spec = "export"
            idemlock_concurrency = 0

            def run(self) -> None: ...

    assert str(info.value) == (
        "task crowded: idemlock_concurrency must be None or an int from 1 to 10000 (the "
        "most jobs of one concurrency key running at once), got 0"
    )
    with pytest.raises(ConfigurationError, match="idemlock_concurrency_key needs idemlock_conc"):

        class Keyed(idem_celery.IdempotentTask):
            name = "keyed"
            idemlock_spec = "export"
            idemlock_concurrency_key = staticmethod(lambda tenant: tenant)

            def run(self, tenant: str) -> None: ...


def test_a_concurrency_limit_is_a_semaphore_named_after_the_spec_with_its_lease() -> None:
    options = JobOptions(
        IdempotencySpec("export", lease=timedelta(seconds=7)),
        concurrency=3,
        concurrency_wait=timedelta(milliseconds=250),
    )
    assert options.permits == SemaphoreSpec("export.concurrency", limit=3, ttl=timedelta(seconds=7))
    assert options.concurrency_wait == 0.25
    assert JobOptions("export").permits is None  # no limit unless asked for


def test_job_options_hold_seconds_and_a_tuple_of_replay_errors() -> None:
    options = JobOptions(
        "charge",
        retry_every=timedelta(milliseconds=1500),
        replay_errors=[KeyError],  # type: ignore[arg-type]  # any iterable at run time
    )
    assert options.retry_every == 1.5
    assert options.replay_errors == (KeyError,)
    assert (options.store_retry_backoff, options.store_retry_max) == (1.0, 60.0)


def test_a_job_names_its_coordinator_option_when_it_is_not_one() -> None:
    @idem_rq.idempotent_job("charge", coordinator=lambda: 42)  # type: ignore[arg-type,return-value]
    def charge(order_id: str) -> str:
        return order_id

    with pytest.raises(ConfigurationError) as info:
        charge("o-1")
    assert "job test_a_job_names_its_coordinator_option_when_it_is_not_one.<locals>.charge: " in (
        str(info.value)
    )
    assert "coordinator must be an idemlock.Coordinator (the job is sync)" in str(info.value)
    assert "the callable returned a builtins.int" in str(info.value)
