"""A tiny Django project for tests/test_django.py: Django's own sessions and
authentication, and a header-driven ``request.user`` for tests without logins."""

import os

SECRET_KEY = "test-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.django_app.urls"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "idemlock.integrations.django",  # its system checks and manage.py idemlock
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJANGO_TEST_DB", ":memory:"),
    }
}
USE_TZ = True
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
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
