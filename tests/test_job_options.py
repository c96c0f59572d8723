"""One ``JobOptions`` checks the options of every queue's idempotent job (issue 22): the
same option refused the same way by RQ's and Dramatiq's decorators and Celery's task
(arq's decorator is the same call, tested in tests/test_arq.py's session). No store,
no broker: the options are checked when the job is made."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from idemlock import ConfigurationError
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
