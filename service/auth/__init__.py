"""Who may do what: named tokens and their roles (:mod:`~jaxpod.service.auth.tokens`),
the role each RPC and HTTP route needs (:mod:`~jaxpod.service.auth.roles`), and the
slice quotas of token owners (:mod:`~jaxpod.service.auth.quotas`). The audit log lives
with the job store.

Imports :mod:`jaxpod.service.sessions` (quotas count what sessions hold); never jobs,
the API or HTTP.
"""
