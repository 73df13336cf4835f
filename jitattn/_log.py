"""The `jitattn` logger: silent by default, JITATTN_VERBOSE=1/2 prints info/debug to stderr."""
import logging

from jitattn.jit import env


def setup_logging() -> None:
    logger = logging.getLogger("jitattn")
    level = env.verbosity()
    if level > 0 and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[jitattn %(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if level >= 2 else logging.INFO)
