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
   a line number is read); otherwise every frame.
3. ``summary()`` lists them outermost first as ``traceback.FrameSummary`` whose source line is
   read when printed. fx's own filter (which keeps every frame kept here) and ``format()`` run
   unchanged, so ``node.meta["stack_trace"]`` is the same text.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from types import FrameType

import torch.fx.proxy as fx_proxy

_Frame = tuple[str, int, str]  # file, line, function


class _ShownFrames:
    """Stand-in for ``torch.utils._traceback.CapturedTraceback`` in fx's ``create_node``."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = frames  # innermost first

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> _ShownFrames:
        """The Python frames above the caller's (``skip`` more left out), step 2."""
        if script or cpp:
            raise NotImplementedError("autopar's stack recorder captures Python frames only")
        caller = sys._getframe(1 + skip)
        tracer = caller.f_locals.get("self")
        forward_only = bool(getattr(tracer, "_record_forward_stack_traces_only", False))
        return _ShownFrames(_walk(caller, forward_only))

    def summary(self) -> traceback.StackSummary:
        """The frames outermost first, their source lines read on demand (step 3)."""
        frames = [traceback.FrameSummary(*f, lookup_line=False) for f in reversed(self.frames)]
        return traceback.StackSummary.from_list(frames)


def _walk(frame: FrameType | None, forward_only: bool) -> list[_Frame]:
    """(file, line, function) of ``frame`` and its callers, innermost first; with
    ``forward_only`` just those fx's forward-frame filter keeps (``_filter_traceback_frames``)."""
    anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", set())
    frames: list[_Frame] = []
    while frame is not None:
        code = frame.f_code
        name, path = code.co_name, code.co_filename
        if (
            not forward_only
            or name == "forward"
            or path.endswith("torch/__init__.py")
            or (path, name) in anchors
        ):
            frames.append((path, frame.f_lineno, name))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def shown_frames() -> Iterator[None]:
    """fx records node stack traces through ``_ShownFrames`` inside (step 1)."""
    if not hasattr(fx_proxy, "CapturedTraceback"):
        yield
        return
    captured = fx_proxy.CapturedTraceback
    fx_proxy.CapturedTraceback = _ShownFrames
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = captured
