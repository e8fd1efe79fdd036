"""Work that must run whole: SIGINT (Ctrl-C), SIGTERM and SIGHUP held back until it ends, then delivered.

Used where an interrupt halfway would leave things that disagree: a finished checkpoint moving into place
(quant/writer.py), `eightbit eval`'s three result files (eval/cli.py), and the engine's bookkeeping around each
step: scheduling, forking samples, appending each sequence's new token and checking its stop conditions
(llm_engine.LLMEngine).
"""

import signal
import threading
from contextlib import contextmanager

import _signal  # signal.py's core: its wrappers try to make every handler an enum member, 10x the cost of a swap

ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a service stopped, the terminal closed
CTRL_C = (signal.SIGINT,)


@contextmanager
def signals_deferred(signals=ENDING_SIGNALS):
    """The signals arriving while the block runs take effect when it ends: a handler of ours notes them and they go
    to the previous handlers once those are back. Main thread only (the only one that may set handlers; Python
    runs them there whichever thread the signal reached); a signal ignored, or whose handler Python did not set, is
    left alone. (The engine holds back SIGINT alone at every step: SIGTERM and SIGHUP end the process there, which
    leaves nothing of it to keep consistent.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = {}  # signal -> the frame it first arrived in
    held = [s for s in signals if _signal.getsignal(s) not in (None, signal.SIG_IGN)]
    previous = {s: _signal.signal(s, lambda signum, frame: arrived.setdefault(signum, frame)) for s in held}
    try:
        yield
    finally:
        # SIGINT's handler back last and SIGINT delivered last: a Ctrl-C coming now ends this block at once, which
        # must find the other handlers back (one left with our recorder would ignore its signal for good) and the
        # other signals delivered
        for s in sorted(previous, key=lambda s: s == signal.SIGINT):
            _signal.signal(s, previous[s])
        for s in sorted(arrived, key=lambda s: s == signal.SIGINT):
            _deliver(s, previous[s], arrived[s])


def _deliver(signum, handler, frame):
    """A Python handler is called, not the signal raised again: the signal has already reached a wakeup fd
    (asyncio's add_signal_handler, whose loop would run its callback twice); SIG_DFL's action needs the signal."""
    if callable(handler):
        handler(signum, frame)
    else:
        signal.raise_signal(signum)
