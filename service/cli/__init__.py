"""The service's commands: ``jaxpod serve`` (:mod:`~jaxpod.service.cli.serve` parses it
and picks the provider; :mod:`~jaxpod.service.cli.serving` runs the process),
``jaxpod cluster`` (:mod:`~jaxpod.service.cli.cluster`), ``jaxpod deploy render``
(:mod:`~jaxpod.service.cli.deploy_render`), and the serve process's malloc settings
(:mod:`~jaxpod.service.cli.malloc`). The top of the service: may import any of it.
"""
