"""What every HTTP adapter (ASGI, FastAPI, WSGI, Flask, Django) shares, written once.
Private: users import the adapters (``idemlock.integrations.asgi`` and the others).

* :mod:`.options`: the options, typed for users' checkers and checked at run time;
* :mod:`.core`: the ``Idempotency-Key`` decision steps over a store face;
* :mod:`.blocking`: those steps driven on a blocking server;
* :mod:`.key_header`: the header's value; :mod:`.problem_json`: the answers;
* :mod:`.recorded_response`: what a response records and how it replays;
* :mod:`.fingerprint` and :mod:`.jcs`: the request's fingerprint, over canonical JSON.
"""
