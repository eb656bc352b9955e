"""The way to the upstream: pooled HTTP/1.1 connections, egress proxies, and per-upstream traits.

:mod:`~proxy.transport.client` is what the request path holds (one sender per replica, errors
mapped once); :mod:`~proxy.transport.pool` the connection pool and sending;
:mod:`~proxy.transport.http1` the connection's protocol, headers and bodies;
:mod:`~proxy.transport.egress` the route to an origin (direct, or through a proxy);
:mod:`~proxy.transport.traits` what kvwarm learned about one upstream.
"""
