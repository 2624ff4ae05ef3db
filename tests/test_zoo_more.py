"""More HF causal-LM families (autopar.tools.zoo.MORE), each from one generic tiny config: it
traces, and verify at Mesh(tp=2) matches the single-device model (loss, logits, every
gradient).  Found by trying every causal LM of transformers 5.23 a user may bring; families
whose export fails for a reason autopar reports clearly are checked for that error."""

from __future__ import annotations

import logging

import pytest

from autopar import Mesh, TraceError, autoparallelize, verify
from autopar.tools import zoo

pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", zoo.MORE)
def test_family_verifies_at_tp2(model_type):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, args, kwargs = zoo.build_generic(model_type)
    report = verify(model, Mesh(tp=2), args, example_kwargs=kwargs)
    assert report.ok, str(report)


def test_data_dependent_expert_sizes_are_a_clear_trace_error():
    """JetMoe sizes its expert batches with ``.tolist()``: no fixed-shape plan exists."""
    model, args, kwargs = zoo.build_generic("jetmoe")
    with pytest.raises(TraceError, match="data-dependent shape"):
        autoparallelize(model, Mesh(tp=2), args, example_kwargs=kwargs)
