from django.urls import path

from . import views

urlpatterns = [
    path("mw/charges", views.charges),
    path("single", views.single),
    path("drf/charges", views.DrfCharges.as_view()),
]
