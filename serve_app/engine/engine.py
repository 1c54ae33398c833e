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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.engine.detokenizer import IncrementalDetokenizer
from serve_app.engine.model import DecoderModel, read_generation_eos
from serve_app.engine.request import Completion, Request, RequestOutput
from serve_app.engine.sampling import SamplingParams, make_generator, process_logits, sample
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.stopping import StopChecker

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know; built from ``serve_app.config.Settings`` by the caller."""

    max_slots: int = 8
    max_seq_len: int = 4096
    max_waiting: int = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


class SpecEngine:
    """Continuous-batching generation over one target model."""

    def __init__(
        self, model: DecoderModel, tokenizer: object, config: EngineConfig, eos_ids: Sequence[int] = ()
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.cache = model.new_cache(config.max_slots, config.max_seq_len)
        self.scheduler = Scheduler([self.cache], config.max_waiting)
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset(i for i in (*eos_ids, tokenizer_eos) if i is not None)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        dtype: str = "bfloat16",
        device: str = "auto",
    ) -> SpecEngine:
        """Load a model folder (as resolved by the model store) with its tokenizer."""
        from transformers import AutoTokenizer

        model = DecoderModel.from_pretrained(path, DTYPES[dtype], resolve_device(device))
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, config or EngineConfig(), read_generation_eos(path))

    # ----------------------------------------------------------------------------- requests
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: raw text, chat text (through the chat template), or ids."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return self.encode_messages(messages)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a raw prompt instead")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
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
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            generator=None if params.greedy else make_generator(params.seed, self.model.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stopper=StopChecker.from_params(params, self.eos_ids),
        )
        self.scheduler.add(request)  # may raise QueueFullError
        self._requests[request_id] = request
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its slot (no-op for an unknown or finished id)."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            request.aborted = True
            self.scheduler.finish(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----------------------------------------------------------------------------- stepping
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One engine step: prefill the newly admitted, decode one token for the others."""
        plan = self.scheduler.plan()
        outputs: list[RequestOutput] = []
        for request in plan.prefill:
            logits = self._prefill(request)
            outputs.append(self._emit(request, self._sample([request], logits)[0]))
        if plan.decode:
            logits = self._decode(plan.decode)
            for request, token in zip(plan.decode, self._sample(plan.decode, logits), strict=True):
                outputs.append(self._emit(request, token))
        return outputs

    def _prefill(self, request: Request) -> torch.Tensor:
        tokens = torch.tensor([request.prompt_ids], device=self.model.device)  # [1, P]
        hidden = self.model.forward(tokens, self.cache, [request.slot])
        self.cache.set_length(request.slot, len(request.prompt_ids))
        return self.model.logits(hidden[:, -1])  # [1, V]

    def _decode(self, requests: list[Request]) -> torch.Tensor:
        tokens = torch.tensor([[r.output_ids[-1]] for r in requests], device=self.model.device)  # [B, 1]
        slots = [r.slot for r in requests]
        hidden = self.model.forward(tokens, self.cache, slots)
        for slot in slots:
            self.cache.set_length(slot, self.cache.lengths[slot] + 1)
        return self.model.logits(hidden[:, -1])  # [B, V]

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        # logits: [B, V] float32, one row per request.
        if all(r.generator is None for r in requests):
            return logits.argmax(dim=-1).tolist()  # greedy: skip building distributions
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in requests], device=device)
        top_k = torch.tensor([r.params.top_k for r in requests], device=device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=device)
        probs = process_logits(logits, temperature, top_k, top_p)  # [B, V]
        return sample(probs, [r.generator for r in requests]).tolist()

    def _emit(self, request: Request, token: int) -> RequestOutput:
        """Append one token, run the stop checks, finish the request if it is done."""
        now = time.perf_counter()
        if request.first_token_time is None:
            request.first_token_time = now
        request.output_ids.append(token)
        text = request.stopper.feed(token, request.detokenizer.push([token])).text
        if request.stopper.finished:
            text += request.stopper.flush(request.detokenizer.flush())
            request.finish_time = now
            self.scheduler.finish(request)
            self._requests.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            new_text=text,
            finished=request.finished,
            finish_reason=request.finish_reason if request.finished else None,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(request.output_ids),
        )

    # ----------------------------------------------------------------------------- helpers
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request to completion (alongside anything already queued), yielding its outputs."""
        request_id = self.add_request(prompt_ids, params)
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
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run several requests as one continuous batch; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        requests = {i: self._requests[i] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        while any(not r.finished for r in requests.values()):
            for output in self.step():
                if output.request_id in texts:
                    texts[output.request_id].append(output.new_text)
        return [
            Completion(
                request_id=i,
                prompt_ids=r.prompt_ids,
                token_ids=list(r.output_ids),
                text="".join(texts[i]),
                finish_reason=r.finish_reason,
                time_to_first_token=(r.first_token_time - r.arrival_time) if r.first_token_time else None,
                duration=(r.finish_time or time.perf_counter()) - r.arrival_time,
            )
            for i, r in requests.items()
        ]
