"""Deployment tools: the KubeRay manifests of ``k8s/overlays/`` rendered from Settings.

- ``deploy.kuberay``: the command line (``python -m deploy.kuberay``): render, write and check
  (drift) each overlay's ``rayservice.yaml``; ``fetch-models`` for the init container;
- ``deploy.profiles``: each overlay's cluster profile (image tag, pod sizes, placement);
- ``deploy.serve_config``: the serveConfigV2 document and its checks;
- ``deploy.manifest``: the RayService manifest (Ray cluster, pods, probes, environment);
- ``deploy.fetch_models``: the init container's model fetch.

Importing this package imports nothing.
"""
