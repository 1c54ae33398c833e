"""`specserve`: generate, serve, policies, models, calibrate, bench, loadtest, soak.

Each command turns its flags into settings overrides (``FLAG_SETTINGS``), builds ``Settings``
through ``serve_app.config.build_settings`` (flags over environment over YAML over defaults), and
calls the serving package or a tool. Choices of proposers and policies come from their registries.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from policies.registry import registered_policies
from serve_app.config import OFF, Settings, build_settings
from serve_app.engine.proposers.registry import registered_proposers

# Flag (argparse dest) -> the setting it overrides, for every command that has the flag.
FLAG_SETTINGS = {
    "model": "model.target",
    "draft_model": "model.draft",
    "dtype": "runtime.dtype",
    "device": "runtime.device",
    "threads": "runtime.threads",
    "method": "speculation.method",
    "depth": "speculation.depth",
    "policy": "speculation.policy",
    "host": "server.host",
    "port": "server.port",
    "api_key": "server.api_key",
    "served_model_name": "server.served_model_name",
    "min_replicas": "autoscaling.min_replicas",
    "max_replicas": "autoscaling.max_replicas",
    "replica_cpus": "autoscaling.replica_num_cpus",
}


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings with the command line's explicit choices on top (a flag left out changes nothing)."""
    overrides = {
        setting: value
        for flag, setting in FLAG_SETTINGS.items()
        if (value := getattr(args, flag, None)) is not None
    }
    return build_settings(overrides)


def cmd_models(args: argparse.Namespace) -> int:
    from serve_app.builder import model_store

    store = model_store(build_settings())
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


def cmd_generate(args: argparse.Namespace) -> int:
    from serve_app.builder import build_engine
    from serve_app.engine.device import set_threads
    from serve_app.engine.params import SamplingParams

    settings = settings_from(args)
    set_threads(settings.runtime.threads)
    engine = build_engine(settings, max_slots=1)
    prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
    # as the API: without --max-tokens, sampling.max_tokens, else to the end of the context
    room = engine.config.max_seq_len - len(prompt_ids)
    params = SamplingParams(
        max_tokens=args.max_tokens or max(min(settings.sampling.max_tokens or room, room), 1),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
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
    from policies import DEFAULT_POLICY

    for name, description in registered_policies().items():
        default = " (default)" if name == DEFAULT_POLICY else ""
        print(f"{name:16s} {description}{default}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serve_app.local_server import serve_locally

    return serve_locally(settings_from(args))


def cmd_calibrate(args: argparse.Namespace) -> int:
    from loadtest.calibrate.command import run_calibrate

    return run_calibrate(args, settings_from(args))


def cmd_train_heads(args: argparse.Namespace) -> int:
    from training.command import run_train_heads

    return run_train_heads(args, settings_from(args))


def cmd_bench(args: argparse.Namespace) -> int:
    if args.quality:
        from loadtest.bench.quality import measure_quality

        return measure_quality(args, settings_from(args))
    if args.sampling_schemes:
        from loadtest.bench.schemes import compare_schemes

        return compare_schemes(args, settings_from(args))
    if args.first_minute:
        from loadtest.bench.first_minute import run_first_minute

        return run_first_minute(args, settings_from(args))
    if args.policies:
        from loadtest.bench.policies import run_policy_bench

        return run_policy_bench(args, settings_from(args))
    from loadtest.bench.run import run_bench

    return run_bench(args, settings_from(args))


def cmd_loadtest(args: argparse.Namespace) -> int:
    from loadtest.run_matrix import run_matrix

    return run_matrix(args, build_settings())


def cmd_soak(args: argparse.Namespace) -> int:
    from loadtest.soak import run_soak

    return run_soak(args, build_settings())


def runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="pack name, local HF folder or hub id (default: settings)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        help="default: settings (auto: float32 for q8 / gguf weights on a CPU, else bfloat16)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: settings (auto)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")


def speculation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", dest="draft_model", help="draft model (default: settings)")
    p.add_argument("--method", choices=[OFF, *registered_proposers()], help="speculation (default: settings)")
    p.add_argument("--depth", type=int, help="draft tokens per step (default: settings)")
    p.add_argument(
        "--policy", choices=list(registered_policies()), help="speculation policy (default: settings)"
    )


def build_parser() -> argparse.ArgumentParser:
    from loadtest.bench.arguments import add_arguments as bench_arguments
    from loadtest.calibrate.command import add_arguments as calibrate_arguments
    from loadtest.matrix_arguments import add_arguments as loadtest_arguments
    from loadtest.soak import add_arguments as soak_arguments
    from training.command import add_arguments as heads_arguments

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    runtime_flags(gen)
    speculation_flags(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument(
        "--max-tokens", type=int, help="default: sampling.max_tokens, else to the end of the context"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
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
    speculation_flags(srv)
    srv.add_argument("--host", help="address to bind (default: settings, 127.0.0.1)")
    srv.add_argument("--port", type=int, help="HTTP port (default: settings, 8000)")
    srv.add_argument("--api-key", help="require `Authorization: Bearer <key>` (default: settings, none)")
    srv.add_argument("--served-model-name", help="the model name clients send (default: the target's)")
    srv.add_argument("--min-replicas", type=int, help="fewest engine replicas (default: settings, 1)")
    srv.add_argument(
        "--max-replicas", type=int, help="most engine replicas, added under load (default: settings, 1)"
    )
    srv.add_argument(
        "--replica-cpus", type=float, help="CPUs each engine replica reserves in Ray (default: settings, 2)"
    )
    srv.set_defaults(func=cmd_serve)

    calibrate = sub.add_parser("calibrate", help="calibrate a proposer for a model (stored with the model)")
    calibrate_arguments(calibrate, runtime_flags)
    calibrate.set_defaults(func=cmd_calibrate)

    heads = sub.add_parser("train-heads", help="train EAGLE / Medusa heads on a target (stored with it)")
    runtime_flags(heads)
    heads_arguments(heads)
    heads.set_defaults(func=cmd_train_heads)

    bench = sub.add_parser(
        "bench", help="benchmark our decoding, plain and speculative, against transformers"
    )
    runtime_flags(bench)
    bench.add_argument(
        "--draft",
        dest="draft_model",
        help="draft model for the draft and assisted methods (default: settings)",
    )
    bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    loadtest = sub.add_parser(
        "loadtest", help="Locust load matrix: policies x load levels x workload mixes, cost report"
    )
    loadtest_arguments(loadtest)
    loadtest.set_defaults(func=cmd_loadtest)

    soak = sub.add_parser(
        "soak", help="many short requests with client cancels against one replica: nothing may leak"
    )
    soak_arguments(soak)
    soak.set_defaults(func=cmd_soak)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    from serve_app.packs.store import StoreError

    try:
        return args.func(args)
    except (StoreError, ValueError, FileNotFoundError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
