"""The request path: one request, read, planned, sent, relayed, recorded and reported.

:mod:`~proxy.request.pipeline` runs the steps in order over a :class:`~proxy.request.turn.Turn`;
:mod:`~proxy.request.parser` parses each body once, a re-sent conversation only past what it shares;
:mod:`~proxy.request.relay` relays the response through the wire's observer and returns how it
ended; :mod:`~proxy.request.report` writes the headers, metrics and log line;
:mod:`~proxy.request.failopen` is the boundary every enriching step runs under;
:mod:`~proxy.request.diagnosis` asks the provider why its cache missed.
"""
