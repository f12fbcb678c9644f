"""transformers' own logging in our processes: quiet by default, its progress bars for one slow call."""

import contextlib
from collections.abc import Iterator


def quiet_transformers() -> None:
    """No per-shard progress bars or advisory warnings from transformers in our logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@contextlib.contextmanager
def transformers_progress() -> Iterator[None]:
    """transformers' own progress bars for one slow call, when someone watches a terminal."""
    from transformers.utils import logging as hf_logging

    from molt_hpc.log import interactive

    if not interactive():
        yield
        return
    hf_logging.enable_progress_bar()
    try:
        yield
    finally:
        hf_logging.disable_progress_bar()
