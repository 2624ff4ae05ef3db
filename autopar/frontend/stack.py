"""The user's stack on each traced node, recorded without symbolising every frame.

fx's ``TracerBase.create_node`` gives each node torch.export makes a ``stack_trace``: it
captures the whole Python stack (``CapturedTraceback.extract()``, ~100 frames at a decoder
layer's ops: the model's calls under export's, fake-tensor's and the dispatcher's), symbolises
every frame (file, line, function, source text), then keeps only the frames its tracer shows.
The tracers of ``torch.export`` show only forward frames (``_record_forward_stack_traces_only``:
functions named ``forward``, ``torch/__init__.py``, registered anchors), a handful per node, so
most of that work (~25% of an export) is thrown away.

Algorithm:
1. Inside ``shown_frames()``, ``torch.fx.proxy`` reads ``CapturedTraceback`` as
   ``_ShownFrames`` (restored on exit; a torch without that name is left alone).
2. ``_ShownFrames.extract()`` walks the caller's frames outwards. When the calling tracer
   shows forward frames only, it keeps the frames that filter keeps (the same test, made before
   a line number is read, once per code object); otherwise every frame.
3. A forward-only walk that reaches a ``forward`` frame it has seen on an earlier walk stops
   there and appends the frames that walk kept above it: a frame still on the stack has the
   same callers, each suspended at the same line, as when it was first walked (a module's
   forward stays on the stack while every op inside it is traced, so each op walks only the
   ~35 frames of dispatch below its innermost forward, not the ~40 of export above).
4. ``summary()`` lists them outermost first as ``traceback.FrameSummary`` whose source line is
   read when printed. fx's own filter (which keeps every frame kept here) and ``format()`` run
   unchanged, so ``node.meta["stack_trace"]`` is the same text.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import traceback
from collections.abc import Iterator
from types import CodeType, FrameType

import torch.fx.proxy as fx_proxy

_Frame = tuple[str, int, str]  # file, line, function
# a generator's or coroutine's frame is resumed by whoever calls next(): its callers change
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class _ShownFrames:
    """Stand-in for ``torch.utils._traceback.CapturedTraceback`` in fx's ``create_node``."""

    __slots__ = ("frames",)
    walker: _Walker | None = None  # the memos of the current ``shown_frames()``

    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = frames  # innermost first

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> _ShownFrames:
        """The Python frames above the caller's (``skip`` more left out), step 2."""
        if script or cpp:
            raise NotImplementedError("autopar's stack recorder captures Python frames only")
        caller = sys._getframe(1 + skip)
        tracer = caller.f_locals.get("self")
        walker = _ShownFrames.walker or _Walker()
        if getattr(tracer, "_record_forward_stack_traces_only", False):
            return _ShownFrames(walker.forward_frames(caller))
        return _ShownFrames(_every_frame(caller))

    def summary(self) -> traceback.StackSummary:
        """The frames outermost first, their source lines read on demand (step 4)."""
        frames = [traceback.FrameSummary(*f, lookup_line=False) for f in reversed(self.frames)]
        return traceback.StackSummary.from_list(frames)


def _every_frame(frame: FrameType | None) -> list[_Frame]:
    """(file, line, function) of ``frame`` and its callers, innermost first."""
    frames: list[_Frame] = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


class _Walker:
    """Forward-only walks (steps 2-3) and their memos, for the length of one ``shown_frames()``
    (the frames it holds are let go on exit)."""

    def __init__(self) -> None:
        self.anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", set())
        self.seen_anchors = len(self.anchors)
        self.shown: dict[CodeType, bool] = {}  # code -> kept by fx's forward-frame filter
        self.above: dict[FrameType, tuple[list[_Frame], int]] = {}  # forward frame -> step 3

    def forward_frames(self, frame: FrameType | None) -> list[_Frame]:
        """(file, line, function) of the frames fx's forward-frame filter keeps
        (``_filter_traceback_frames``) among ``frame`` and its callers, innermost first."""
        if len(self.anchors) != self.seen_anchors:  # an anchor registered since: ask again
            self.shown.clear()
            self.above.clear()
            self.seen_anchors = len(self.anchors)
        frames: list[_Frame] = []
        forwards: list[tuple[FrameType, int]] = []  # forward frames walked, where they are kept
        while frame is not None:
            code = frame.f_code
            shown = self.shown.get(code)
            if shown is None:
                shown = self.shown[code] = self._shows(code)
            if shown:
                frames.append((code.co_filename, frame.f_lineno, code.co_name))
                if code.co_name == "forward" and not code.co_flags & _RESUMABLE:
                    known = self.above.get(frame)
                    if known is not None:
                        kept, at = known
                        frames += kept[at:]
                        break
                    forwards.append((frame, len(frames)))
            frame = frame.f_back
        for forward, at in forwards:
            self.above[forward] = (frames, at)
        return frames

    def _shows(self, code: CodeType) -> bool:
        name, path = code.co_name, code.co_filename
        return (name == "forward" or path.endswith("torch/__init__.py")
                or (path, name) in self.anchors)  # fmt: skip


@contextlib.contextmanager
def shown_frames() -> Iterator[None]:
    """fx records node stack traces through ``_ShownFrames`` inside (step 1)."""
    if not hasattr(fx_proxy, "CapturedTraceback"):
        yield
        return
    captured = fx_proxy.CapturedTraceback
    fx_proxy.CapturedTraceback = _ShownFrames
    _ShownFrames.walker = _Walker()
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = captured
        _ShownFrames.walker = None
