"""Proposers: who drafts the tokens the target verifies. Registered by name; see ``registry``.

Importing this package registers the built-in proposers (each module registers itself).
"""

from serve_app.engine.proposers import draft_model as _draft_model  # noqa: F401  (registers "draft")
from serve_app.engine.proposers import ngram as _ngram  # noqa: F401  (registers "ngram")
from serve_app.engine.proposers import self_spec as _self_spec  # noqa: F401  (registers "self")
from serve_app.engine.proposers.base import (
    Draft,
    LookaheadProposer,
    ModelDrafter,
    Proposer,
    ProposeRow,
    needs_prefill,
)
from serve_app.engine.proposers.registry import (
    ProposerContext,
    ProposerFactory,
    cold_acceptance,
    create_proposer,
    register_proposer,
    registered_proposers,
)

__all__ = [
    "Draft",
    "LookaheadProposer",
    "ModelDrafter",
    "ProposeRow",
    "Proposer",
    "ProposerContext",
    "ProposerFactory",
    "cold_acceptance",
    "create_proposer",
    "needs_prefill",
    "register_proposer",
    "registered_proposers",
]
