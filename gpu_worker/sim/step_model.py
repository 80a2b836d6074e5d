"""Step-time models for the continuous-batching simulator (`gpu_worker.sim.engine.SimEngine`).

Not to be confused with the scheduler's request cost (``cost_model: requests | tokens |
kv_seconds``, `dispatcher.scheduler.cost`), which prices requests for fair sharing. A
step model is a small JSON file that says how fast one engine replica runs, so that
the simulator's step times, batch cap and KV-cache size behave like a real deployment.
Files live in ``gpu_worker/sim/step_models/<name>.json`` (loaded by name) or anywhere on
disk (loaded by path). The calibration script measures an engine and writes this
format; ``default.json`` ships hand-picked, *not measured* numbers.

Format (version 1; every field below is a top-level JSON key)::

    {
      "format_version": 1,
      "name": "default",                  # short id, also the file's stem by convention
      "measured": false,                  # true only when written by a calibration run
      "measured_on": "",                  # hardware + engine + model, free text
      "command": "",                      # the command line that produced the file
      "notes": "",                        # anything a reader should know
      "max_num_seqs": 256,                # batch cap the numbers were measured with
      "kv_block_size_tokens": 16,         # tokens per paged-KV block
      "kv_tokens_total": 100000,          # KV-cache capacity in tokens (all blocks)
      "prefill_tokens_per_s": 12000.0,    # prompt tokens processed per second
      "step_base_ms": 8.0,                # decode step: fixed cost
      "step_per_seq_ms": 0.1,             # decode step: per running sequence
      "step_per_kv_token_ms": 0.00025     # decode step: per KV token in use
    }

Step time: one engine step decodes one token for every running sequence and takes

    step_ms = step_base_ms + step_per_seq_ms * num_running
              + step_per_kv_token_ms * kv_tokens_in_use
              + 1000 * prefill_tokens_this_step / prefill_tokens_per_s

i.e. a prefill of ``n`` prompt tokens adds ``n / prefill_tokens_per_s`` seconds to the
step it runs in (as with vLLM's mixed prefill/decode batches). Unknown keys are
ignored so a calibration script may add extra measurements (e.g. raw samples).
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

STEP_MODELS_DIR = Path(__file__).with_name("step_models")
FORMAT_VERSION = 1


class StepModelError(ValueError):
    """A step model file is missing or invalid (a ValueError, so msgspec reports it
    with the field path when raised from validation)."""


def prefill_ms(num_tokens: int, prefill_tokens_per_s: float) -> float:
    """A prefill's duration: the one formula, for `StepModel.prefill_ms` and for callers
    that keep the rate as a float (`BatchCore.run_coeffs`, compiled)."""
    return 1000.0 * num_tokens / prefill_tokens_per_s


class StepModel(msgspec.Struct, kw_only=True):
    name: str
    max_num_seqs: int
    kv_block_size_tokens: int
    kv_tokens_total: int
    prefill_tokens_per_s: float
    step_base_ms: float
    step_per_seq_ms: float
    step_per_kv_token_ms: float
    format_version: int = FORMAT_VERSION
    measured: bool = False
    measured_on: str = ""
    command: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise StepModelError("max_num_seqs must be >= 1")
        if self.kv_block_size_tokens < 1:
            raise StepModelError("kv_block_size_tokens must be >= 1")
        if self.kv_tokens_total < self.kv_block_size_tokens:
            raise StepModelError("kv_tokens_total must hold at least one block")
        if self.prefill_tokens_per_s <= 0:
            raise StepModelError("prefill_tokens_per_s must be > 0")
        if min(self.step_base_ms, self.step_per_seq_ms, self.step_per_kv_token_ms) < 0:
            raise StepModelError("step costs must be >= 0")

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_tokens_total // self.kv_block_size_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.kv_block_size_tokens)

    def prefill_ms(self, num_tokens: int) -> float:
        return prefill_ms(num_tokens, self.prefill_tokens_per_s)

    def step_ms(self, num_running: int, kv_tokens_in_use: int, prefill_tokens: int = 0) -> float:
        """Simulated duration of one engine step (see the module docstring)."""
        return (
            self.step_base_ms
            + self.step_per_seq_ms * num_running
            + self.step_per_kv_token_ms * kv_tokens_in_use
            + self.prefill_ms(prefill_tokens)
        )

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"


_decoder = msgspec.json.Decoder(StepModel)


def parse_step_model(data: bytes | str, source: str = "<bytes>") -> StepModel:
    try:
        model = _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise StepModelError(f"invalid step model {source}: {exc}") from None
    if model.format_version != FORMAT_VERSION:
        raise StepModelError(
            f"step model {source} has format_version {model.format_version}, "
            f"this simulator reads {FORMAT_VERSION}"
        )
    return model


def resolve_step_model_path(name_or_path: str) -> Path:
    """A bare name (``default``) means ``step_models/<name>.json``; anything with a path
    separator or a ``.json`` suffix is a file path."""
    if "/" in name_or_path or name_or_path.endswith(".json"):
        return Path(name_or_path).expanduser()
    return STEP_MODELS_DIR / f"{name_or_path}.json"


def load_step_model(name_or_path: str = "default") -> StepModel:
    path = resolve_step_model_path(name_or_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        known = ", ".join(available_step_models()) or "none"
        raise StepModelError(
            f"cannot read step model {name_or_path!r} ({path}): {exc.strerror}; "
            f"shipped models: {known}"
        ) from None
    return parse_step_model(data, str(path))


def available_step_models() -> list[str]:
    return sorted(p.stem for p in STEP_MODELS_DIR.glob("*.json"))


def save_step_model(model: StepModel, path: str | Path) -> None:
    Path(path).write_bytes(model.to_json())
