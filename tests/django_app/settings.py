"""A tiny Django project for tests/test_django.py (no database: identities come from
a header-driven ``request.user``)."""

import os

SECRET_KEY = "test-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.django_app.urls"
INSTALLED_APPS: list[str] = []
DATABASES: dict[str, object] = {}
USE_TZ = True
MIDDLEWARE = [
    "tests.django_app.views.HeaderUserMiddleware",
    "idemlock.integrations.django.IdempotencyMiddleware",
]
IDEMLOCK = {
    "url": os.environ.get("DJANGO_TEST_STORE", "memory://"),
    "spec": {"name": "http", "ttl": 3600, "lease": 30},
    "identity": "user",
    "routes": ["/mw/*"],
}
REST_FRAMEWORK: dict[str, object] = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
}
