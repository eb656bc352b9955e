"""The HTTP edge: what holds before a request reaches the request path.

:mod:`~proxy.edge.defences` bounds paths, bodies and connections against hostile clients;
:mod:`~proxy.edge.tenancy` names the tenant a request belongs to. The handlers themselves are
:mod:`proxy.app`.
"""
