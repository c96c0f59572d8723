from django.urls import path

from . import views

urlpatterns = [
    path("mw/charges", views.charges),
    path("mw/stream", views.stream),
    path("single", views.single),
    path("strict", views.strict),
    path("down", views.down),
    path("drf/charges", views.DrfCharges.as_view()),
]
