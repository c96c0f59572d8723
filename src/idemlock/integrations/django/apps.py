"""The Django application of idemlock: add ``"idemlock.integrations.django"`` to
``INSTALLED_APPS`` for its system checks (``manage.py check``) and its management
command (``manage.py idemlock ...``). It has no models and no migrations."""

from __future__ import annotations

from django.apps import AppConfig


class IdemlockConfig(AppConfig):  # type: ignore[misc]  # Django has no type information here
    name = "idemlock.integrations.django"
    label = "idemlock"
    verbose_name = "idemlock"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the checks)
