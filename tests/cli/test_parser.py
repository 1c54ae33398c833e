"""The command line: flags become settings overrides; choices come from the registries."""

from __future__ import annotations

from policies.registry import registered_policies
from serve_app.engine.proposers.registry import registered_proposers
from specserve.cli import build_parser, settings_from


def test_serve_and_generate_accept_every_registered_method() -> None:
    for method in ["off", *registered_proposers()]:
        args = build_parser().parse_args(["serve", "--method", method, "--model", "t"])
        assert settings_from(args).speculation.method == method
        assert build_parser().parse_args(["generate", "--prompt", "x", "--method", method]).method == method


def test_flags_left_out_change_nothing_and_given_ones_win(monkeypatch) -> None:
    monkeypatch.setenv("SPECSERVE_SERVER__PORT", "9100")
    args = build_parser().parse_args(["serve", "--model", "t", "--host", "0.0.0.0", "--threads", "2"])
    settings = settings_from(args)
    assert (settings.model.target, settings.server.host, settings.server.port) == ("t", "0.0.0.0", 9100)
    assert settings.runtime.threads == 2
    policy = next(iter(registered_policies()))
    args = build_parser().parse_args(["generate", "--prompt", "x", "--policy", policy, "--depth", "3"])
    assert (settings_from(args).speculation.policy, settings_from(args).speculation.depth) == (policy, 3)


def test_calibrate_takes_the_runtime_flags() -> None:
    args = build_parser().parse_args(["calibrate", "self-spec", "--model", "m", "--budget-s", "30"])
    assert (args.proposer, args.model, args.budget_s, args.max_depth) == ("self-spec", "m", 30.0, 6)
