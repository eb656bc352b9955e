"""The pure core: identity, matching, repair, break diagnosis, SSE decoding, usage and pricing.

Nothing here imports aiohttp or does I/O: functions take values and return values.
"""
