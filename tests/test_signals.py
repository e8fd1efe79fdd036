"""engine/signals.py: work that must run whole holds SIGINT, SIGTERM and SIGHUP back, then hands them on."""

import asyncio
import signal
import sys
import threading

import pytest

from eightbit.engine.signals import CTRL_C, signals_deferred


def test_a_ctrl_c_in_the_block_comes_after_it():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_raise_once_at_the_outer_end():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred(CTRL_C):
            with signals_deferred(CTRL_C):
                signal.raise_signal(signal.SIGINT)
            done.append("after the inner block")
    assert done == ["after the inner block"]


def test_other_handlers_are_back_and_their_signals_raised_before_a_ctrl_c():
    """A Ctrl-C raised at the end must find every other handler back (one left with the block's recorder would
    ignore its signal for good) and the other signals delivered first."""
    seen = []

    def handler(signum, frame):
        seen.append(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGHUP)
                assert seen == []
        assert sorted(seen) == sorted([signal.SIGTERM, signal.SIGHUP])  # before the KeyboardInterrupt
        assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGHUP) is handler
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def test_an_ignored_ctrl_c_stays_ignored_and_a_handler_of_the_caller_s_runs_once_after():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
        seen = []
        signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_off_the_main_thread_nothing_is_held():
    """(Only the main thread may set handlers; Python runs them there.)"""
    errors = []

    def work():
        try:
            with signals_deferred():
                pass
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_asyncio_signal_callback_runs_once():
    """asyncio's add_signal_handler hears a signal through a wakeup fd, written as the signal arrives, in the block:
    delivering it again at the end would run the loop's callback twice."""
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, calls.append, "ctrl-c")
        try:
            with signals_deferred(CTRL_C):
                signal.raise_signal(signal.SIGINT)
            for _ in range(5):
                await asyncio.sleep(0.01)
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    asyncio.run(main())
    assert calls == ["ctrl-c"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_signal_s_handler_gets_the_frame_it_arrived_in():
    frames = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: frames.append(frame))
    try:
        with signals_deferred(CTRL_C):
            signal.raise_signal(signal.SIGINT)
            here = sys._getframe()
        assert frames == [here]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_error_in_the_block_puts_the_handlers_back_and_a_held_ctrl_c_still_comes():
    with pytest.raises(ZeroDivisionError):
        with signals_deferred():
            1 / 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt) as raised:
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            1 / 0
    assert isinstance(raised.value.__context__, ZeroDivisionError)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_the_moment_its_handler_is_back_finds_the_others_back(monkeypatch):
    import eightbit.engine.signals as signals_module

    core = signals_module._signal  # what the module sets handlers through
    real = core.signal

    def set_then_ctrl_c(s, handler):
        old = real(s, handler)
        if s == signal.SIGINT and handler is signal.default_int_handler:
            signal.raise_signal(signal.SIGINT)
        return old

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}  # SIGHUP is ignored under nohup
    monkeypatch.setattr(core, "signal", set_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            pass
    monkeypatch.undo()
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_arriving_twice_in_a_block_is_handled_once():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
