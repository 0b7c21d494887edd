"""The doors of a server replica: every way a request reaches it, and how each closes.

``listener`` (the replica's own port: SO_REUSEPORT, pause/resume, stop on Serve's
signal), ``guard`` (bounds before any key on that port, held requests ended before
Serve's ``ray.kill``), ``haproxy`` (``dsv4-haproxy``: Ray's HAProxy with its stats and
Prometheus frontends on loopback), ``behind_haproxy`` (the app as HAProxy's server sees
it: Serve's health path, counted requests), ``haproxy_target`` (the replica's own port
as HAProxy's server, in place of Ray's direct-ingress port), ``dataplane`` (the drain
gate on Serve's ``/-/healthz`` answer), ``stopping`` (whether Serve began stopping this
replica). Imports ``config`` and the light root modules only: ``serving`` composes the
doors, never the reverse.
"""
