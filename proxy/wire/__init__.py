"""Wire APIs: one front-end (request planning) and one response observer per API.

:mod:`proxy.wire.chat` speaks ``/v1/chat/completions``. A new wire API adds a module
here implementing :class:`proxy.wire.base.Wire`; the matcher, repair, store and break
diagnosis are shared (``proxy.core``). Everything here is pure: no aiohttp, no I/O.
"""
