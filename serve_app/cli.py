"""`specserve` command line: serve, generate, models, calibrate, bench, loadtest."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from serve_app.config import Settings, load_settings

if TYPE_CHECKING:
    from serve_app.engine.engine import EngineConfig

METHODS = ("off", "draft", "ngram", "self")  # speculation.method (self: no draft model needed)


def _settings(args: argparse.Namespace) -> Settings:
    """Settings from env/YAML, with the command line's explicit choices on top."""
    base = load_settings()
    runtime = base.runtime.model_dump()
    for key in ("dtype", "device", "threads"):
        if getattr(args, key, None) is not None:
            runtime[key] = getattr(args, key)
    model = base.model.model_dump()
    if getattr(args, "model", None):
        model["target"] = args.model
    if getattr(args, "draft", None):
        model["draft"] = args.draft
    speculation = base.speculation.model_dump()
    for key in ("method", "depth", "policy"):
        if getattr(args, key, None) is not None:
            speculation[key] = getattr(args, key)
    return Settings(**{**base.model_dump(), "runtime": runtime, "model": model, "speculation": speculation})


def _store(settings: Settings):
    from serve_app.engine.store import ModelStore

    return ModelStore(settings.store.cache_dir)


def cmd_models(args: argparse.Namespace) -> int:
    store = _store(load_settings())
    if args.action == "list":
        for status in store.list():
            spec = status.spec
            state = f"fetched at {status.path}" if status.fetched else "not fetched"
            print(f"{spec.name:32s} {spec.upstream} ({spec.quantization}, {spec.license}): {state}")
    elif args.action == "fetch":
        print(store.fetch(args.name))
    elif args.action == "path":
        print(store.path(args.name))
    return 0


def engine_config(settings: Settings, max_slots: int | None = None) -> EngineConfig:
    """The engine's configuration from settings: cache sizes, speculation, proposer options.

    The draft model is resolved (fetched if needed) only when the method is "draft"; the
    self-speculative proposer is loaded when the method is "self" or ``speculation.self_spec``.
    """
    from serve_app.engine.engine import EngineConfig

    spec = settings.speculation
    options: dict[str, dict[str, object]] = {
        "ngram": {"max_ngram": spec.ngram_max, "min_ngram": spec.ngram_min}
    }
    if spec.method == "draft":
        if not settings.model.draft:
            raise ValueError("speculation method 'draft' needs a draft model (model.draft / --draft)")
        options["draft"] = {
            "draft_path": _store(settings).resolve(settings.model.draft),
            "draft_name": settings.model.draft,
            "target_name": settings.model.target,
            "int8": spec.draft_int8,
            "head_tokens": spec.draft_head_tokens,
            "min_confidence": spec.draft_min_confidence,
        }
    if spec.method == "self" or spec.self_spec:
        options["self"] = {"skip_layers": list(spec.self_spec_skip or [])}
    return EngineConfig(
        max_slots=max_slots or settings.cache.max_slots,
        max_seq_len=settings.cache.max_seq_len,
        spec_method=None if spec.method == "off" else spec.method,
        spec_depth=spec.depth,
        max_depth=spec.max_depth,
        proposer_options=options,
        policy=spec.policy,
        policy_params=dict(spec.policy_params),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.sampling import SamplingParams

    settings = _settings(args)
    if settings.runtime.threads:
        torch.set_num_threads(settings.runtime.threads)
    path = _store(settings).resolve(settings.model.target)
    config = engine_config(settings, max_slots=1)
    engine = SpecEngine.from_path(path, config, settings.runtime.dtype, settings.runtime.device)
    params = SamplingParams(
        max_tokens=args.max_tokens or settings.sampling.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
    start = time.perf_counter()
    first = None
    count = 0
    reason = None
    stats = None
    for output in engine.stream(prompt_ids, params):
        first = first or time.perf_counter()
        count += len(output.new_token_ids)
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
        reason = output.finish_reason
        stats = output.spec_stats or stats
    end = time.perf_counter()
    sys.stdout.write("\n")
    decode_rate = (count - 1) / (end - first) if first and count > 1 else 0.0
    print(
        f"[{count} tokens, finish_reason={reason}, ttft {((first or end) - start) * 1e3:.0f} ms, "
        f"{decode_rate:.2f} tok/s decode]",
        file=sys.stderr,
    )
    if stats is not None and stats.drafted:
        print(f"[speculation: {json.dumps(stats.as_dict())}]", file=sys.stderr)
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from policies import DEFAULT_POLICY, registered_policies

    for name, description in registered_policies().items():
        default = " (default)" if name == DEFAULT_POLICY else ""
        print(f"{name:16s} {description}{default}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from serve_app.calibrate import run_calibrate

    return run_calibrate(args, _settings(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from serve_app.bench import build_engine, run_bench

    if args.policies:
        from serve_app.bench_policies import run_policy_bench

        return run_policy_bench(args, _settings(args), build_engine)
    return run_bench(args, _settings(args))


def _serve_settings(args: argparse.Namespace) -> Settings:
    """``_settings`` plus the HTTP server's flags."""
    base = _settings(args)
    server = base.server.model_dump()
    for key in ("host", "port", "api_key", "served_model_name"):
        if getattr(args, key, None) is not None:
            server[key] = getattr(args, key)
    return Settings(**{**base.model_dump(), "server": server})


def _http_status(url: str) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible API on a local Ray cluster until Ctrl-C, SIGINT or SIGTERM."""
    import os
    import signal

    settings = _serve_settings(args)
    # Fetch the packs here, where their progress shows; the replicas then find them in the store.
    store = _store(settings)
    refs = [settings.model.target]
    if settings.speculation.method == "draft" and settings.model.draft:
        refs.append(settings.model.draft)
    for ref in refs:
        print(f"[specserve] model {ref}: {store.resolve(ref)}", flush=True)

    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.replica import served_model_name

    started_ray = not ray.is_initialized()
    if started_ray:  # a local cluster (never `ray start --head`: port 6379 is Redis's here)
        address = os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False)
    # SIGINT and SIGTERM both shut down cleanly, also where SIGINT was inherited as ignored
    # (a background job of a non-interactive shell) and after ray.init installed its SIGTERM exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        cpus = ray.cluster_resources().get("CPU", 0.0)
        needed = settings.autoscaling.replica_num_cpus * max(1, settings.autoscaling.min_replicas)
        if cpus < needed:
            print(
                f"[specserve] warning: the engine replicas need {needed:g} CPUs, the cluster has {cpus:g}; "
                "set SPECSERVE_AUTOSCALING__REPLICA_NUM_CPUS lower or they will never start",
                file=sys.stderr,
            )
        host, port = settings.server.host, settings.server.port
        serve.start(http_options={"host": host, "port": port})
        app_name = "specserve"
        serve.run_many(
            [serve.RunTarget(build_app(settings.model_dump(mode="json")), name=app_name, route_prefix="/")],
            wait_for_applications_running=False,
        )
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        url = f"http://{local}:{port}"
        print(f"[specserve] starting {app_name}: loading models into the engine replica(s) ...", flush=True)
        start = last = time.monotonic()
        while _http_status(f"{url}/health") != 200:
            status = serve.status().applications.get(app_name)
            if status is not None and str(status.status.value) == "DEPLOY_FAILED":
                print(f"[specserve] deployment failed: {status.message}", file=sys.stderr)
                return 1
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                state = str(status.status.value) if status is not None else "NOT_STARTED"
                details = "; ".join(
                    f"{name}: {d.status.value} {d.message}".strip()
                    for name, d in (status.deployments.items() if status is not None else ())
                )
                print(f"[specserve] {time.monotonic() - start:.0f}s: {state} {details}", flush=True)
            time.sleep(1)
        name = served_model_name(settings)
        key = settings.server.api_key
        auth = f" \\\n  -H 'Authorization: Bearer {key}'" if key else ""
        print(
            f"[specserve] ready after {time.monotonic() - start:.0f}s: {url}  (model {name!r}; "
            f"OpenAI base URL {url}/v1)\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"""  -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], """
            f""""max_tokens": 64}}'\n"""
            "[specserve] Ctrl-C to stop",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\n[specserve] shutting down", flush=True)
        return 0
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()


def cmd_loadtest(args: argparse.Namespace) -> int:
    from loadtest.run_matrix import run_matrix

    return run_matrix(args, load_settings())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def runtime_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="pack name, local HF folder or hub id (default: settings)")
        p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: settings (bfloat16)")
        p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: settings (auto)")
        p.add_argument("--threads", type=int, help="torch threads (default: all cores)")

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    runtime_flags(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, help="default: settings (256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--draft", help="draft model for --method draft (default: settings)")
    gen.add_argument("--method", choices=METHODS, help="speculation (default: settings)")
    gen.add_argument("--depth", type=int, help="draft tokens per step (default: settings)")
    gen.add_argument("--policy", help="speculation policy (`specserve policies`; default: settings)")
    gen.set_defaults(func=cmd_generate)

    policies_cmd = sub.add_parser("policies", help="list the registered speculation policies")
    policies_cmd.set_defaults(func=cmd_policies)

    models = sub.add_parser("models", help="list, fetch or locate model packs")
    msub = models.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="the known packs and whether they are fetched")
    msub.add_parser("fetch", help="download, verify and convert a pack").add_argument("name")
    msub.add_parser("path", help="the converted folder of a fetched pack").add_argument("name")
    models.set_defaults(func=cmd_models)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve (until Ctrl-C)")
    runtime_flags(srv)
    srv.add_argument("--draft", help="draft model for --method draft (default: settings)")
    srv.add_argument("--method", choices=METHODS, help="speculation (default: settings)")
    srv.add_argument("--depth", type=int, help="draft tokens per step (default: settings)")
    srv.add_argument("--host", help="address to bind (default: settings, 127.0.0.1)")
    srv.add_argument("--port", type=int, help="HTTP port (default: settings, 8000)")
    srv.add_argument("--api-key", help="require `Authorization: Bearer <key>` (default: settings, none)")
    srv.add_argument("--served-model-name", help="the model name clients send (default: the target's)")
    srv.set_defaults(func=cmd_serve)

    calibrate = sub.add_parser("calibrate", help="calibrate a proposer for a model (stored with the model)")
    csub = calibrate.add_subparsers(dest="proposer", required=True)
    self_spec = csub.add_parser(
        "self-spec", help="search the layers the self-speculative draft skips (a few minutes)"
    )
    runtime_flags(self_spec)
    self_spec.add_argument("--budget-s", type=float, default=240.0, help="time budget of the search")
    self_spec.add_argument("--max-tokens", type=int, default=48, help="reference tokens per prompt")
    self_spec.add_argument("--max-depth", type=int, default=6, help="deepest draft considered")
    self_spec.add_argument("--no-write", action="store_true", help="print the result, store nothing")
    self_spec.add_argument(
        "--curve",
        type=int,
        nargs="+",
        metavar="C",
        help="instead: acceptance/cost/speedup for C layers skipped (stores nothing)",
    )
    self_spec.add_argument("--rank-starts", type=int, default=32, help="starts ranking layers for --curve")
    calibrate.set_defaults(func=cmd_calibrate)

    bench = sub.add_parser(
        "bench", help="benchmark our decoding, plain and speculative, against transformers"
    )
    runtime_flags(bench)
    bench.add_argument("--draft", help="draft model for the draft and assisted methods (default: settings)")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument(
        "--warmup",
        choices=["each", "first"],
        default="each",
        help="one warm-up run of every method before each prompt (each) or only before the first (first)",
    )
    bench.add_argument("--kinds", nargs="*", help="prompt kinds to run: code json chat prose (default: all)")
    bench.add_argument(
        "--methods",
        nargs="+",
        metavar="METHOD",
        help="methods to run (default: all): specserve-plain, specserve-draft-d<k> (k of --depths or any), "
        "specserve-ngram, transformers-plain, transformers-assisted, transformers-lookup",
    )
    bench.add_argument(
        "--depths", nargs="+", type=int, default=[2, 4, 6, 8], help="draft depths (default: 2 4 6 8)"
    )
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers methods")
    bench.add_argument(
        "--sweep",
        nargs="+",
        type=int,
        metavar="C",
        help="also measure plain vs speculative throughput at these concurrencies (e.g. 1 2 4 8 16)",
    )
    bench.add_argument(
        "--sweep-modes",
        nargs="+",
        choices=["plain", "draft", "ngram", "self"],
        help="modes of --sweep (default: plain draft ngram self; self runs at its calibrated depth)",
    )
    bench.add_argument(
        "--cost-curve",
        action="store_true",
        help="also time target forwards of 1..32 tokens per row at batch 1 and 8, and the draft step",
    )
    bench.add_argument(
        "--policies",
        action="store_true",
        help="compare the speculation policies instead: simulated from acceptance traces (and, with "
        "--real-loads, real engine runs); see serve_app/bench_policies.py",
    )
    bench.add_argument("--traces", help="--policies: trace file to replay (default: the shipped Qwen traces)")
    bench.add_argument("--record-traces", metavar="PATH", help="--policies: record traces (and cost) first")
    bench.add_argument("--loads", nargs="+", type=int, help="--policies: simulated load levels (1..32)")
    bench.add_argument("--real-loads", nargs="+", type=int, help="--policies: load levels to run for real")
    bench.add_argument(
        "--mix-repeats",
        type=int,
        help="--policies: interleaved rounds of the real mixed workload (default: --repeats)",
    )
    bench.add_argument(
        "--no-priors",
        action="store_true",
        help="--policies: start every policy from what a fresh engine assumes (each proposer's "
        "cold acceptance, else the estimator's default), not from the traces' pooled acceptance",
    )
    bench.add_argument(
        "--estimator",
        nargs="+",
        metavar="NAME=VALUE",
        help="--policies: acceptance estimator parameters for the simulation (alpha, prior_weight, "
        "pool_alpha, relax, default, decay; see policies/acceptance.py), e.g. pool_alpha=0.05",
    )
    bench.add_argument("--out", default="bench-results", help="folder for the JSON and Markdown results")
    bench.set_defaults(func=cmd_bench)

    from loadtest.run_matrix import add_arguments

    loadtest = sub.add_parser(
        "loadtest", help="Locust load matrix: policies x load levels x workload mixes, cost report"
    )
    add_arguments(loadtest)
    loadtest.set_defaults(func=cmd_loadtest)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    from serve_app.engine.store import StoreError

    try:
        return args.func(args)
    except (StoreError, ValueError, FileNotFoundError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
