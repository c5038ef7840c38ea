"""Sub-millisecond timers on an asyncio event loop (uvloop), without spinning.

uvloop's timers tick in whole milliseconds: ``loop.call_at`` may fire up to ~1.3 ms early or
~0.6 ms late (measured), and ``loop.time()`` is floored to the millisecond. A deferred batch is
grantable only in a window about alpha (~1 ms) wide, and an emulated GPU must finish its batch
at ``start + l(b)``, so the scheduler, the backends and the emulated executor need better.

:class:`PreciseTimers` is one Linux ``timerfd`` per event loop, armed at the earliest pending
deadline in absolute ``CLOCK_MONOTONIC`` time (the clock of ``time.monotonic()``), and watched
with ``loop.add_reader``: the kernel's high-resolution timer wakes the loop (lateness ~0.1 ms at
the median on an idle core, never early), and the process sleeps meanwhile. The thread's timer
slack is lowered to ``TIMER_SLACK_NS`` so the kernel does not batch the wake-up with others.
Callbacks run on the loop thread, in deadline order, never before their deadline.

Elsewhere (no timerfd, e.g. macOS) it falls back to the loop's own timer armed ``POLL_WINDOW_S``
early and the last stretch polled with ``call_soon`` through loop iterations: as precise, but it
burns a core while polling.

Use ``timers_for(loop)`` to get the loop's instance; ``call_at(when, callback)`` returns a
handle with ``cancel()``; ``await sleep_until(when)`` waits until ``time.monotonic() >= when``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zserve.core.timer_heap import LazyTimerHeap

if TYPE_CHECKING:
    from zserve.runtime.clock import ClusterClock

log = logging.getLogger(__name__)

# Fallback only: the loop's timer is armed this much early and the rest is polled.
POLL_WINDOW_S = 0.0015
# The kernel may delay a timer wake-up by the thread's timer slack (default 50 us) to batch it.
TIMER_SLACK_NS = 1000
# Compact the heap when cancelled entries outnumber live ones by this factor (and it is large).
_COMPACT_FACTOR = 2
_COMPACT_MIN = 256

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_PR_SET_TIMERSLACK = 29


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _TimerFd:
    """A non-blocking ``CLOCK_MONOTONIC`` timerfd armed at absolute times (Linux, via libc)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        create.restype = ctypes.c_int
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                  ctypes.c_void_p]
        self._settime.restype = ctypes.c_int
        fd = create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        # Closed with its owner (a loop that is dropped without close() leaks no descriptor).
        self._finalizer = weakref.finalize(self, os.close, fd)
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)
        # A smaller timer slack for this (the loop's) thread: wake-ups on time.
        with contextlib.suppress(AttributeError, OSError):
            libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(TIMER_SLACK_NS), 0, 0, 0)

    def arm(self, when: float) -> None:
        """Fire at monotonic time ``when`` (at once if it has passed)."""
        when = max(when, 1e-6)  # an all-zero it_value would disarm the timer instead
        seconds = int(when)
        value = self._spec.it_value
        value.tv_sec = seconds
        value.tv_nsec = int((when - seconds) * 1e9)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, self._ref, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def consume(self) -> None:
        with contextlib.suppress(BlockingIOError):  # already consumed by another read
            os.read(self.fd, 8)

    def close(self) -> None:
        self._finalizer()


class TimerHandle:
    """A callback scheduled with :meth:`PreciseTimers.call_at`."""

    __slots__ = ("_owner", "callback", "cancelled", "when")

    def __init__(self, owner: PreciseTimers, when: float, callback: Callable[[], Any]) -> None:
        self._owner = owner
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._owner._heap.mark_stale()


class PreciseTimers:
    """Every precise timer of one event loop; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, use_timerfd: bool = True) -> None:
        # A weak reference: ``timers_for`` keys instances by loop in a WeakKeyDictionary, whose
        # values must not keep their keys alive.
        self._loop_ref = weakref.ref(loop)
        self._heap: LazyTimerHeap[TimerHandle] = LazyTimerHeap(_handle_is_live)
        self._armed_at = math.inf
        self._fd: _TimerFd | None = None
        self._fallback: asyncio.Handle | None = None
        if use_timerfd and sys.platform.startswith("linux"):
            try:
                self._fd = _TimerFd()
                loop.add_reader(self._fd.fd, self._on_fire)
            except (OSError, AttributeError, NotImplementedError) as exc:
                log.warning("no timerfd (%s): timers poll through loop iterations", exc)
                if self._fd is not None:
                    self._fd.close()
                self._fd = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop_ref()
        if loop is None:
            raise RuntimeError("the event loop of these timers is gone")
        return loop

    @property
    def uses_timerfd(self) -> bool:
        return self._fd is not None

    def call_at(self, when: float, callback: Callable[[], Any]) -> TimerHandle:
        """Call ``callback()`` on the loop once ``time.monotonic() >= when``."""
        handle = TimerHandle(self, when, callback)
        heap = self._heap
        heap.push(when, handle)
        if when < self._armed_at:
            self._arm(when)
        if heap.stale > _COMPACT_MIN:
            # stale > _COMPACT_FACTOR * live, i.e. size > (_COMPACT_FACTOR + 1) * live
            heap.compact_if(len(heap) - heap.stale, factor=_COMPACT_FACTOR + 1,
                            minimum=_COMPACT_MIN)
        return handle

    def close(self) -> None:
        """Drop every pending timer and release the timerfd."""
        for handle in self._heap.drain():
            handle.cancelled = True
        self._armed_at = math.inf
        if self._fallback is not None:
            self._fallback.cancel()
            self._fallback = None
        if self._fd is not None:
            loop = self._loop_ref()
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self._fd.fd)
            self._fd.close()
            self._fd = None

    # ------------------------------------------------------------------ internals

    def _arm(self, when: float) -> None:
        self._armed_at = when
        if self._fd is not None:
            self._fd.arm(when)
            return
        if self._fallback is not None:
            self._fallback.cancel()
        remaining = when - time.monotonic()
        if remaining > POLL_WINDOW_S:
            # loop.time() is the same clock as time.monotonic(), floored to the millisecond.
            self._fallback = self.loop.call_at(self.loop.time() + remaining - POLL_WINDOW_S,
                                               self._on_fire)
        else:
            self._fallback = self.loop.call_soon(self._on_fire)

    def _on_fire(self) -> None:
        if self._fd is not None:
            self._fd.consume()
        self._fallback = None
        self._armed_at = math.inf
        heap = self._heap
        now = time.monotonic()
        # ``now`` is read once: a callback that schedules another timer for a moment already
        # past is run on the next wake-up (at once), never in a loop here.
        while (handle := heap.pop_due(now)) is not None:
            handle.cancelled = True  # fired: a later cancel() is a no-op
            try:
                handle.callback()
            except Exception:
                log.exception("timer callback %r failed", handle.callback)
        next_at = heap.next_at()
        if next_at != math.inf:
            self._arm(next_at)


def _handle_is_live(when: float, handle: TimerHandle) -> bool:
    return not handle.cancelled


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PreciseTimers] = (
    weakref.WeakKeyDictionary()
)


def timers_for(loop: asyncio.AbstractEventLoop | None = None) -> PreciseTimers:
    """The PreciseTimers of ``loop`` (default: the running loop), created on first use."""
    loop = loop or asyncio.get_running_loop()
    timers = _BY_LOOP.get(loop)
    if timers is None or timers.loop.is_closed():
        timers = _BY_LOOP[loop] = PreciseTimers(loop)
    return timers


async def sleep_until(when: float) -> None:
    """Return once ``time.monotonic() >= when`` (a precise timer; no spinning)."""
    if time.monotonic() >= when:
        return
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not future.done():
            future.set_result(None)

    handle = timers_for(loop).call_at(when, wake)
    try:
        await future
    finally:
        handle.cancel()


class WakeTimer:
    """One timer for one pure object's ``wake_at`` (see ``zserve.core.hosting``).

    ``sync()`` after every call into the object re-arms the timer when ``wake_at`` moved; when the
    moment comes the timer calls ``fire()``, which must call ``obj.on_timer(now, ...)`` and flush.
    ``wake_at`` is on the cluster clock when ``clock`` is given (``zserve.runtime.clock``): the
    timer is armed at ``clock.to_local(wake_at)``, this process's own CLOCK_MONOTONIC.

    Precision matters: a deferred batch is granted between its frontrun moment and its latest
    moment, which are only l(bs + 1) - l(bs) (alpha, often ~1 ms) apart, and uvloop's own timers
    tick in whole milliseconds. The timer is a precise timer of this module (a timerfd on
    Linux): the object is woken a few tens of microseconds after its moment, never before it, and
    the process sleeps until then.
    """

    __slots__ = ("_at", "_clock", "_fire", "_handle", "_timers", "obj")

    def __init__(self, loop: asyncio.AbstractEventLoop, obj: Any, fire: Callable[[], None],
                 clock: ClusterClock | None = None):
        self._timers = timers_for(loop)
        self._clock = clock
        self.obj = obj
        self._fire = fire
        self._handle: TimerHandle | None = None
        self._at = math.inf

    def sync(self) -> None:
        wake_at: float = self.obj.wake_at
        if wake_at == self._at:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._at = wake_at
        if wake_at != math.inf:
            local = wake_at if self._clock is None else self._clock.to_local(wake_at)
            self._handle = self._timers.call_at(local, self._on_handle)

    def _on_handle(self) -> None:
        self._handle = None
        self._at = math.inf
        self._fire()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._at = math.inf
