"""``python -m gpu_worker``: one GPU worker (simulator or vLLM engine)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fairlane import otel, runtime
from fairlane.gctune import tuned_gc
from fairlane.logs import configure_logging
from fairlane.settings import load_settings
from gpu_worker.config import WorkerSettings


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(
        WorkerSettings,
        argv,
        prog="gpu_worker",
        description="fairlane GPU worker: pulls work from the dispatcher and runs an engine",
    )
    configure_logging(settings.log_level, settings.log_json)
    otel.setup("gpu_worker")  # only if the otel extra is installed and OTEL_* asks
    from gpu_worker.service import serve

    try:
        with tuned_gc(settings.gc_young_objects):  # after the imports: frozen
            return runtime.run(lambda stop: serve(settings, stop))
    finally:
        otel.shutdown()


if __name__ == "__main__":
    sys.exit(main())
