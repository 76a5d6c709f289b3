"""A default handler for the "pocketllm" logger, so that `LLM()` users see what loading did.

It prints only while the application has configured no logging of its own (no handler on the
root logger); otherwise records propagate to the application's handlers as usual, and nothing is
printed twice. POCKETLLM_CONFIGURE_LOGGING=0 leaves logging alone (as VLLM_CONFIGURE_LOGGING does).
"""
from __future__ import annotations

import logging
import sys

from pocketllm import envs

FORMAT = "%(levelname)s %(name)s: %(message)s"


class _DefaultHandler(logging.StreamHandler):
    def __init__(self) -> None:
        logging.Handler.__init__(self)  # no stream of its own: sys.stderr at each record (it may be replaced)
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self):
        return sys.stderr

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and super().filter(record)


def configure_logging() -> None:
    """Add the default handler once; the level is INFO unless the application set one."""
    if envs.get("POCKETLLM_CONFIGURE_LOGGING") == "0":
        return
    logger = logging.getLogger("pocketllm")
    if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    logger.addHandler(_DefaultHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
