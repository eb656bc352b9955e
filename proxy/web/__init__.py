"""The live page at ``/kvwarm/``: what kvwarm did for the cache, with nothing else installed.

A dashboard served by kvwarm itself on the proxy port, for the operator who ran
``make run`` and has no Grafana: server-rendered HTML, a small script that polls
``/kvwarm/api/overview`` every few seconds, and a stylesheet; no CDN, no build step,
no third-party code. Access follows the admin API's rule (:func:`proxy.ops.admin.decide_access`).

Modules, one concept each:

``counters``   kvwarm's own Prometheus counters, read from the app's registry as one :class:`Totals`
``history``    a ring of per-minute snapshots of those totals (24 h), sampled once a minute
``activity``   the latest prefix-break examples per tenant and reason, with the pin line to paste
``overview``   everything the page shows, as one JSON-able value (what the API returns)
``view``       the overview formatted for people: the strings and chart geometry the page binds
``page``       the HTML document rendered from a view (the script re-binds the same slots)
``routes``     the aiohttp edge: ``/kvwarm/``, ``/kvwarm/api/overview``, ``/kvwarm/static/*``,
               and the sampler task owned by the app's ``cleanup_ctx``

Several workers or replicas: each process has its own registry, ring and break examples,
and the page shows the process that answered it (its pid is on the page). Sessions come
from the transcript store, which is shared when the store is.
"""
