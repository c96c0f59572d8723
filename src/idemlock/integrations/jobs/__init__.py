"""What the queue integrations (Celery, RQ, arq, Dramatiq) share, written once.
Private: users import the integrations (``idemlock.integrations.rq`` and the others).

* :mod:`.options`: :class:`~.options.JobOptions`, the options of an idempotent job,
  and :class:`~.options.SendArgs`, the one calling convention of ``enqueue_once``
  (``enqueue_once(<queue's handle>, args=(...), kwargs={...}, lease=..., **options)``);
* :mod:`.sends`: the send lease behind ``enqueue_once``;
* :mod:`.guard`: a job's body run once per key, and its coming back later;
* :mod:`.celery_messages` and :mod:`.celery_resends`: Celery's task messages (the
  task itself keeps its own claim, see ``idemlock.integrations.celery``).
"""
