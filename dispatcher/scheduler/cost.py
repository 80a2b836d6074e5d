"""Cost models: what one request costs, in the units the fair policies share out.

Each model estimates a request's cost at dispatch (from what the request declares) and
computes its actual cost on finish (from `ActualUsage`); the policy charges the
estimate and trues it up by the difference. Chosen per pool by `make_cost_model`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig
from fairlane.registry import choose


class CostModel(Protocol):
    name: ClassVar[str]

    def estimate(self, req: QueuedRequest) -> float: ...
    def actual(self, req: QueuedRequest, usage: ActualUsage) -> float: ...


class RequestCost:
    """Every request costs 1: streaming endpoints, where a turn is about one request."""

    name: ClassVar[str] = "requests"

    def __init__(self, config: SchedulerConfig) -> None:
        pass

    def estimate(self, req: QueuedRequest) -> float:
        return 1.0

    def actual(self, req: QueuedRequest, usage: ActualUsage) -> float:
        return 1.0


class TokenCost:
    """prompt × w_p + output × w_q (VTC's weighting: output tokens cost more)."""

    name: ClassVar[str] = "tokens"

    def __init__(self, config: SchedulerConfig) -> None:
        self.w_prompt = config.prompt_token_weight
        self.w_output = config.output_token_weight

    def estimate(self, req: QueuedRequest) -> float:
        return req.prompt_tokens * self.w_prompt + req.expected_output_tokens * self.w_output

    def actual(self, req: QueuedRequest, usage: ActualUsage) -> float:
        return usage.prompt_tokens * self.w_prompt + usage.completion_tokens * self.w_output


class KvSecondsCost:
    """KV-cache-token-seconds: the binding resource of a serving engine.

    The estimate integrates KV occupancy over the request's life from the pool's step
    times: the prompt's KV is held from prefill to the end, and each generated token adds
    one more. With P prompt and O output tokens, a decode step of `s` seconds and a
    prefill of `p` seconds per prompt token:
        P·(P·p) + s·(P·O + O·(O+1)/2)
    The actual cost is the engine's measured `kv_token_seconds` when it reports one,
    otherwise the same formula on the actual token counts.
    """

    name: ClassVar[str] = "kv_seconds"

    def __init__(self, config: SchedulerConfig) -> None:
        self.step_s = config.kv_step_ms / 1000.0
        self.prefill_s_per_token = config.kv_prefill_ms_per_token / 1000.0

    def _formula(self, prompt_tokens: int, output_tokens: int) -> float:
        p, o = max(prompt_tokens, 0), max(output_tokens, 0)
        prefill = p * (p * self.prefill_s_per_token)
        decode = self.step_s * (p * o + o * (o + 1) / 2)
        return max(prefill + decode, 1e-6)  # never free: a zero cost would never end a turn

    def estimate(self, req: QueuedRequest) -> float:
        return self._formula(req.prompt_tokens, req.expected_output_tokens)

    def actual(self, req: QueuedRequest, usage: ActualUsage) -> float:
        if usage.kv_token_seconds > 0:
            return usage.kv_token_seconds
        return self._formula(usage.prompt_tokens, usage.completion_tokens)


_COST_MODELS: dict[str, Callable[[SchedulerConfig], CostModel]] = {
    RequestCost.name: RequestCost,
    TokenCost.name: TokenCost,
    KvSecondsCost.name: KvSecondsCost,
}


def make_cost_model(config: SchedulerConfig) -> CostModel:
    return choose(_COST_MODELS, config.cost_model, "cost model")(config)
