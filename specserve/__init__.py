"""The ``specserve`` command line: the top of the import graph.

It parses arguments and calls the serving package (``serve_app``) or a tool (``loadtest`` for
benchmarks, load tests and calibration; ``deploy`` for the KubeRay renderer). Nothing imports it.
"""
