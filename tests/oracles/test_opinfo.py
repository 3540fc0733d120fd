"""torch's OpInfo database as the oracle: every op that supports autograd in float64, its
sample inputs, under vjp / .backward() / vmap(grad) / grad(grad) and the built-in
policies, through a plan shared between two regions, and at other sizes (a template's
specialized plans), and in bf16 compared bitwise, against the same call without remat (see
opinfo_cases.py). The outcome counts per transform are printed at the end of the run."""

from __future__ import annotations

import pytest
from opinfo_cases import BF16_OPS, OPS, SHARED_TRANSFORMS, TRANSFORMS, run_bf16_case, run_case, run_resized_case, run_shared_case

pytestmark = [pytest.mark.opinfo, pytest.mark.filterwarnings("ignore")]  # torch's deprecation warnings, unmatched policies


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("op_name", list(OPS))
def test_op_matches_no_remat(op_name: str, transform: str, record_property: pytest.RecordProperty) -> None:
    rows = run_case(op_name, transform)
    record_property("opinfo", [(transform, outcome) for _, _, outcome in rows])


@pytest.mark.parametrize("transform", list(SHARED_TRANSFORMS))
@pytest.mark.parametrize("op_name", list(OPS))
def test_a_plan_shared_between_regions_matches_no_remat(
    op_name: str, transform: str, record_property: pytest.RecordProperty
) -> None:
    """The second of two regions of one op (its own values and captured tensors) shares
    the first's plan when the graphs are the same; either way it matches no remat."""
    rows = run_shared_case(op_name, transform)
    record_property("opinfo", [(f"shared plan, {transform}", outcome) for _, _, outcome in rows])


@pytest.mark.parametrize("op_name", list(OPS))
def test_an_op_at_other_sizes_matches_no_remat(op_name: str, record_property: pytest.RecordProperty) -> None:
    """One region called on the same sample drawn at other sizes: the second size traces a
    template, later ones are specialized from it; each matches no remat."""
    rows = run_resized_case(op_name)
    record_property("opinfo", [("other sizes, backward", outcome) for _, _, outcome in rows])


@pytest.mark.parametrize("op_name", list(BF16_OPS))
def test_an_op_in_bf16_is_bitwise(op_name: str, record_property: pytest.RecordProperty) -> None:
    """The op's first bf16 sample under .backward(): values and gradients bitwise equal to
    no remat (the same ops in the same dtypes and order)."""
    rows = run_bf16_case(op_name)
    record_property("opinfo", [("bf16, backward", outcome) for _, _, outcome in rows])
