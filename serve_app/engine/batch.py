"""``SpecEngine.generate``'s second half: step a batch of queued requests to their ends and gather
each one's ``Completion`` (text, tokens, timing, speculation, logprobs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from serve_app.engine.request import Completion, Request, RequestOutput
from serve_app.engine.token_logprobs import LogprobRun


def run_batch(step: Callable[[], list[RequestOutput]], batch: Sequence[Request]) -> list[Completion]:
    """Call ``step`` until every request of ``batch`` has finished; completions in batch order."""
    requests = {r.request_id: r for r in batch}
    texts: dict[str, list[str]] = {i: [] for i in requests}
    runs: dict[str, list[LogprobRun | None]] = {i: [] for i in requests}
    prompts: dict[str, LogprobRun | None] = {}
    while any(not r.finished for r in requests.values()):
        for output in step():
            if output.request_id in texts:
                texts[output.request_id].append(output.new_text)
                runs[output.request_id].append(output.logprobs)
                if output.prompt_logprobs is not None:  # the first output's
                    prompts[output.request_id] = output.prompt_logprobs
    return [
        Completion(
            request_id=i,
            prompt_ids=r.prompt_ids,
            token_ids=list(r.output_ids),
            text="".join(texts[i]),
            finish_reason=r.finish_reason,
            time_to_first_token=(r.first_token_time - r.arrival_time) if r.first_token_time else None,
            duration=(r.finish_time or time.perf_counter()) - r.arrival_time,
            spec_stats=r.spec_stats,
            logprobs=LogprobRun.concat(runs[i]),
            prompt_logprobs=prompts.get(i),
        )
        for i, r in requests.items()
    ]
