"""The application as a module-level object, for ``serve build`` (which wants an ``Application``, not
the ``build_app`` builder function that ``serve run`` and KubeRay's ``serveConfigV2`` call with args).

    SPECSERVE_MODEL__TARGET=smollm2-135m-instruct serve build serve_app.serve_entry:app -o serve_config.yaml
    serve deploy serve_config.yaml -a http://<head node>:8265

Importing this module builds the settings from the environment (``SPECSERVE_*``, the YAML file named
by ``SPECSERVE_CONFIG``) and the defaults, as ``serve_app.app.build_app`` does without arguments, and
binds the two deployments with their options. That validates the settings (an invalid value fails
the import with a ``ValueError`` naming the field) but starts no Ray cluster and loads no model: the
replicas load them once deployed. ``serve_app.app`` itself stays free of this import-time work.

``serve build`` writes the deployments' options (autoscaling, ``max_ongoing_requests``, queue bound,
``ray_actor_options``, health checks) into the file, and Serve gives them precedence over the code's.
``serve deploy`` imports this module again on the cluster, so the settings the replicas receive come
from the environment there: give the cluster the same ``SPECSERVE_*`` variables, e.g. in the
application's ``runtime_env: {env_vars: {...}}`` in the file (Serve imports the module and starts the
replicas in that runtime environment).
"""

from __future__ import annotations

from ray import serve

from serve_app.app import build_app

app: serve.Application = build_app()
