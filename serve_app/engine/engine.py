"""SpecEngine: add requests, step, stream tokens out.

The engine is pure torch (no Ray, no HTTP): the serving layer drives ``step()`` from its own loop.
One step = admit what fits (prefill each admitted prompt), then one batched forward over every
running request, then sampling and stop checks, token by token, so that EOS, stop strings and
``max_tokens`` cut the output exactly where plain decoding would.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from policies import FittedCostModel, PolicyConfig, create_policy
from serve_app.engine.attention import tree_exact
from serve_app.engine.batch import run_batch
from serve_app.engine.block_file import resolve_weight_format
from serve_app.engine.decoder_config import read_generation_eos
from serve_app.engine.detokenizer import IncrementalDetokenizer
from serve_app.engine.device import DTYPES, resolve_device, resolve_dtype
from serve_app.engine.drafting import draft_rows, hand_features, lookahead, planned_request
from serve_app.engine.engine_config import COUPLED, EngineConfig
from serve_app.engine.exactness import Exactness, make_exact
from serve_app.engine.grammar import GrammarCompiler, constrain, trim_drafts
from serve_app.engine.kv_cache import KVCache
from serve_app.engine.logprobs import TokenPieces, emitted_logprobs, prompt_logprobs
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.penalties import PenaltyState, penalize
from serve_app.engine.planner import PlannedRequest, SpeculationPlanner, StatsSink
from serve_app.engine.profiling import profile_cost_model
from serve_app.engine.proposers.base import (
    FeatureProposer,
    LookaheadProposer,
    ModelDrafter,
    Proposer,
    branches,
    needs_prefill,
)
from serve_app.engine.proposers.registry import ProposerContext, cold_acceptance, create_proposer
from serve_app.engine.request import Completion, Request, RequestOutput
from serve_app.engine.sampling import PositionNoise, make_generator, new_seed
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.stopping import StopChecker
from serve_app.engine.target_step import score_drafts
from serve_app.engine.verify import verify

log = logging.getLogger(__name__)


class SpecEngine:
    """Continuous-batching generation over one target model, with speculative proposers."""

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: object,
        config: EngineConfig,
        eos_ids: Sequence[int] = (),
        proposers: Mapping[str, Proposer] | None = None,
        stats: StatsSink | None = None,
        model_pair: str = "",
        cache: KVCache | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        # A cache made beforehand is passed in when a proposer drafts inside it (self-speculation).
        self.cache = cache or model.new_cache(config.max_slots, config.max_seq_len)
        if (self.cache.num_slots, self.cache.max_seq_len) != (config.max_slots, config.max_seq_len):
            raise ValueError("the KV cache passed in does not match max_slots / max_seq_len")
        self.scheduler = Scheduler(self.cache, config.max_waiting)
        # Whether a row's numbers are independent of its batch here (engine.exactness); None when off.
        self.exactness = self._make_exact() if config.batch_invariant else None
        self.exact = self.exactness is not None and self.exactness.exact
        # Token trees (engine.tree) only where they stay exact, or where nothing is promised.
        self.trees = self.exactness is None or tree_exact(model.dtype, model.device)
        if not self.trees:
            log.info("token trees off: attention in %s on %s is not exact for them", model.dtype,
                     model.device)  # fmt: skip
        self.proposers: dict[str, Proposer] = dict(proposers or {})
        # Proposers that say their draft length before the step (n-gram): asked for every request.
        self._lookups = {n: p for n, p in self.proposers.items() if isinstance(p, LookaheadProposer)}
        # Proposers that draft from the target's hidden states (heads): fed after every forward.
        self._heads = {n: p for n, p in self.proposers.items() if isinstance(p, FeatureProposer)}
        if config.spec_method is not None and config.spec_method not in self.proposers:
            raise ValueError(
                f"speculation method {config.spec_method!r} has no proposer loaded "
                f"(loaded: {', '.join(self.proposers) or 'none'})"
            )
        policy = create_policy(
            config.policy,
            PolicyConfig(config.spec_method, config.spec_depth, config.max_depth, config.policy_params),
        )
        self.planner = SpeculationPlanner(
            policy, list(self.proposers), config.max_depth, config.spec_method, model_pair, stats=stats,
            cold_priors=cold_acceptance(list(self.proposers)),
            trees={n: config.tree_nodes for n, p in self.proposers.items() if branches(p) and self.trees},
        )  # fmt: skip
        self.use_cost_model(self.planner.cost)
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset(i for i in (*eos_ids, tokenizer_eos) if i is not None)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.pieces = TokenPieces(tokenizer)  # token texts and bytes, for requests asking for logprobs
        # Structured output (response_format): compiles each request's grammar.
        self.grammars = GrammarCompiler(tokenizer, model.cfg.vocab_size, sorted(self.eos_ids))

    def _make_exact(self) -> Exactness:
        """Run the target so that a row's numbers do not depend on its batch or verify width
        (``engine.exactness``); ``exact`` when that holds on this device: speculation is bit-exact."""
        found = make_exact(self.model)
        log.info("exactness: %s", found.describe())
        if not found.exact:
            log.warning(
                "this device cannot make the target's rows independent of their batch (%s); speculative "
                "output may differ from plain decoding here (exact: false)", found.describe(),
            )  # fmt: skip
        return found

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        dtype: str = "bfloat16",
        device: str = "auto",
        stats: StatsSink | None = None,
        model_pair: str = "",
    ) -> SpecEngine:
        """Load a model folder (as resolved by the model store) with its tokenizer; ``dtype`` may be
        ``auto`` (``device.resolve_dtype``: float32 for quantized weights on a CPU)."""
        from transformers import AutoTokenizer

        config = config or EngineConfig()
        device = resolve_device(device)
        config = replace(config, weight_format=resolve_weight_format(config.weight_format, path, str(device)))
        dtype = resolve_dtype(dtype, config.weight_format, device)
        model = DecoderModel.from_pretrained(path, DTYPES[dtype], device, weight_format=config.weight_format)
        tokenizer = AutoTokenizer.from_pretrained(path)
        cache = model.new_cache(config.max_slots, config.max_seq_len)
        context = ProposerContext(
            model, tokenizer, config.max_slots, config.max_seq_len, {}, cache, Path(path)
        )
        proposers = {}
        for name, options in config.proposer_options.items():
            proposers[name] = create_proposer(name, ProposerContext(**{**vars(context), "options": options}))
        return cls(model, tokenizer, config, read_generation_eos(path), proposers, stats, model_pair, cache)

    def profile_cost_model(self, repeats: int = 2) -> FittedCostModel:
        """Time the target and every model-based proposer's draft step on free slots, fit the cost model."""
        drafts = {n: (p.model, p.cache) for n, p in self.proposers.items() if isinstance(p, ModelDrafter)}
        return self.use_cost_model(profile_cost_model(self.model, self.cache, drafts, repeats))

    def use_cost_model(self, cost: FittedCostModel) -> FittedCostModel:
        """Give the planner ``cost`` (profiled here, or shared by another replica), told which of
        this engine's proposers need no prefill to draft for a new request (self-speculation)."""
        for name in (n for n, p in self.proposers.items() if not needs_prefill(p)):
            cost.mark_no_prefill(name)
        self.planner.cost = cost
        return cost

    # ----------------------------------------------------------------------------- requests
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: raw text, chat text (through the chat template), or ids."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return self.encode_messages(messages)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of chat messages through the chat template (given ``tools``, OpenAI's shape)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a raw prompt instead")
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        speculation: SpecOverride | None = None,
        workload: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for a request that can never run."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_seq_len
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum sequence length of {limit} tokens"
            )
        speculation = speculation or SpecOverride()
        if speculation.mode not in ("auto", "off") and speculation.mode not in self.proposers:
            raise ValueError(
                f"speculation mode {speculation.mode!r} is not available; use 'auto', 'off' or one of: "
                f"{', '.join(self.proposers) or '(no proposers loaded)'}"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        coupled = self.config.sampling == COUPLED and not params.greedy
        seed = new_seed() if params.seed is None else params.seed  # an unseeded request draws one
        request = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            generator=None if params.greedy or coupled else make_generator(seed, self.model.device),
            noise=PositionNoise(seed) if coupled else None,
            penalties=PenaltyState.for_request(params, prompt_ids, vocab, self.model.device),
            grammar=self.grammars.compile(params.structured) if params.structured else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stopper=StopChecker.from_params(params, self.eos_ids),
            speculation=speculation,
        )
        self.scheduler.add(request)  # may raise QueueFullError
        self._requests[request_id] = request
        # The classifier reads text; the prompt's last few hundred tokens are plenty.
        text = self.tokenizer.decode(prompt_ids[-512:], skip_special_tokens=True)
        self.planner.admit(request_id, text, workload)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its slot (no-op for an unknown or finished id)."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            request.aborted = True
            self._release(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----------------------------------------------------------------------------- stepping
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One engine step: prefill the newly admitted, then one verify forward for the others."""
        plan = self.scheduler.plan()
        outputs: list[RequestOutput] = []
        for request in plan.prefill:
            outputs.append(self._prefill(request))
        if plan.decode:
            outputs.extend(self._decode(plan.decode))
        return outputs

    def _prefill(self, request: Request) -> RequestOutput:
        tokens = torch.tensor([request.prompt_ids], device=self.model.device)  # [1, P]
        hidden = self.model.forward(tokens, self.cache, [request.slot])
        self.cache.set_length(request.slot, len(request.prompt_ids))
        hand_features(self._heads, request, hidden[0])
        logits = self.model.logits(hidden[:, -1:])  # [1, 1, V]
        scored = penalize(logits, [request], [[]])  # penalties / logit_bias; logprobs read the raw logits
        scored = constrain(scored, [request], [[]])  # the grammar's mask (structured output)
        result = verify(scored, [[]], [None], [request.params], [request.generator], [request.noise_at()])
        output, params = self._emit(request, result.tokens[0]), request.params
        (run,) = emitted_logprobs(logits, [output.new_token_ids], [params.logprobs], self.pieces)
        prompt = None  # the prompt's own logprobs, from the same forward (echo)
        if (top := params.prompt_logprobs) is not None:
            prompt = prompt_logprobs(self.model, hidden, request.prompt_ids, top, self.pieces)
        return replace(output, logprobs=run, prompt_logprobs=prompt)

    def _planned(self, request: Request) -> PlannedRequest:
        draftable = lookahead(self._lookups, request, self.config.max_depth)
        return planned_request(request, self.config.max_seq_len, draftable)

    def _decode(self, requests: list[Request]) -> list[RequestOutput]:
        step_start = time.perf_counter()
        planned = [self._planned(r) for r in requests]
        decisions = self.planner.decide(planned, self.scheduler.num_waiting)
        drafts, draft_seconds, draft_steps = draft_rows(self.proposers, requests, decisions, self.trees)
        drafts = trim_drafts(requests, drafts)  # a token the grammar refuses ends its draft
        target_start = time.perf_counter()
        scored = score_drafts(self.model, self.cache, requests, drafts)
        target_seconds = time.perf_counter() - target_start
        # From the verify forward's logits: a verified position's row is plain decoding's (Exact).
        tops = [r.params.logprobs for r in requests]
        path_logits = scored.kept_logits() if any(t is not None for t in tops) else scored.logits
        runs = emitted_logprobs(path_logits, scored.tokens, tops, self.pieces)
        outputs = []
        for b, (request, decision, draft, accepted, emitted, run) in enumerate(zip(
            requests, decisions, drafts, scored.num_accepted, scored.tokens, runs, strict=True
        )):  # fmt: skip
            # Keep the fed token and the accepted drafts (moved together for a tree); the rest of
            # the row is garbage now.
            self.cache.keep_rows(request.slot, self.cache.lengths[request.slot], scored.rows[b])
            hand_features(self._heads, request, scored.hidden[b, scored.rows[b]])
            if decision.proposer is not None:
                self.proposers[decision.proposer].commit(request.slot, scored.on_chain[b])
            depth = draft.tree.depth if draft.tree is not None else None
            request.spec_stats.record(decision.proposer, draft.width, accepted, depth)
            output = self._emit(request, emitted)
            step = {"step_proposer": decision.proposer, "step_drafted": draft.width,
                    "step_alternatives": draft.width - len(draft.tokens)}
            kept = run.head(len(output.new_token_ids)) if run is not None else None  # a stop drops the rest
            outputs.append(replace(output, step_accepted=accepted, logprobs=kept, **step))
        self.planner.observe(
            planned, decisions, [d.tree.depth if d.tree else len(d.tokens) for d in drafts],
            scored.num_accepted, [len(o.new_token_ids) for o in outputs], target_seconds, draft_seconds,
            draft_steps, time.perf_counter() - step_start, width=1 + max(d.width for d in drafts),
        )  # fmt: skip
        return outputs

    def _emit(self, request: Request, tokens: list[int]) -> RequestOutput:
        """Append tokens one at a time through the stop checks; finish the request if it is done.

        Tokens after the one that finishes the request are dropped, so EOS, a stop string or
        max_tokens inside an accepted run cut the output exactly where plain decoding would.
        """
        now = time.perf_counter()
        if request.first_token_time is None:
            request.first_token_time = now
        kept: list[int] = []
        text = ""
        for token in tokens:
            kept.append(token)
            request.output_ids.append(token)
            text += request.stopper.feed(token, request.detokenizer.push([token])).text
            if request.stopper.finished:
                text += request.stopper.flush(request.detokenizer.flush())
                request.finish_time = now
                self._release(request)
                break
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=kept,
            new_text=text,
            finished=request.finished,
            finish_reason=request.finish_reason if request.finished else None,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(request.output_ids),
            spec_stats=request.spec_stats if request.finished else None,
            scheduled_time=request.scheduled_time,
        )

    def _release(self, request: Request) -> None:
        """Free everything the request holds: its KV slot and any proposer state."""
        slot = request.slot
        self.scheduler.finish(request)
        for name in request.proposers_admitted:
            self.proposers[name].release(slot)
        request.proposers_admitted.clear()
        self.planner.finish(request.request_id)
        self._requests.pop(request.request_id, None)

    # ----------------------------------------------------------------------------- helpers
    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, speculation: SpecOverride | None = None
    ) -> Iterator[RequestOutput]:
        """Run one request to completion (alongside anything already queued), yielding its outputs."""
        request_id = self.add_request(prompt_ids, params, speculation=speculation)
        try:
            while True:
                for output in self.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.abort(request_id)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        speculation: SpecOverride | Sequence[SpecOverride] | None = None,
    ) -> list[Completion]:
        """Run several requests as one continuous batch; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        specs = list(speculation) if isinstance(speculation, Sequence) else [speculation] * len(prompts)
        ids = [
            self.add_request(p, sp, speculation=so)
            for p, sp, so in zip(prompts, params_list, specs, strict=True)
        ]
        return run_batch(self.step, [self._requests[i] for i in ids])
