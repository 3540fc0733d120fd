"""Unit tests of the mechanism's parts, each against an oracle outside remat: the
partitioner on a joint graph make_fx builds (run against torch.func.vjp), graph facts
read from schemas (against torch's own schema text), splitting a call (against the
arguments themselves), and the pairwise cover the default test run takes."""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from remat._core.nodes import NO_DEFAULT, ancestors, schema_defaults, source_line, written_arguments
from remat._partition.partitioning import partition
from remat._trace.arguments import split_call

from conftest import assert_close, pairwise_cover

aten = torch.ops.aten
D = torch.float64


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x @ w) * x.sum()


def _joint(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y, vjp = torch.func.vjp(_f, x, w)
    return (y, *vjp(t))


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(3, 4, dtype=D, generator=gen), torch.randn(4, 5, dtype=D, generator=gen),
            torch.randn(3, 5, dtype=D, generator=gen))


def _partitioned(keep: Any) -> tuple[Any, list[torch.Tensor]]:
    x, w, t = _example()
    joint = make_fx(_joint, tracing_mode="fake")(x, w, t)
    part = partition(joint, n_inputs=2, n_outputs=1, decide=keep)
    forward_out = part.forward(x, w)
    residuals = [forward_out[i] for i in part.residual_outputs]
    saved = [(x, w)[i] for i in part.saved_inputs]
    grads = part.backward(*saved, *residuals, t)
    return part, [forward_out[0], *grads]


def test_partition_keeping_nothing_recomputes_from_the_inputs_and_equals_vjp() -> None:
    part, got = _partitioned(lambda node: False)
    assert part.saved_inputs == [0, 1] and part.kept == []
    assert aten.mm.default in {r.op for r in part.recomputed}
    assert_close(got, list(_joint(*_example())))


def test_partition_keeping_matmuls_keeps_one_value_and_equals_vjp() -> None:
    part, got = _partitioned(lambda node: node.target is aten.mm.default)
    assert [k.op for k in part.kept] == [aten.mm.default] and part.kept[0].shape == (3, 5)
    assert aten.mm.default not in {r.op for r in part.recomputed}
    assert_close(got, list(_joint(*_example())))


def test_partition_keeping_everything_recomputes_nothing() -> None:
    part, got = _partitioned(lambda node: True)
    assert part.recomputed == []
    assert_close(got, list(_joint(*_example())))


def _chain() -> tuple[torch.fx.Graph, list[torch.fx.Node]]:
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    c = graph.call_function(aten.mul.Tensor, (a, b))
    d = graph.call_function(aten.sin.default, (c,))
    e = graph.call_function(aten.add.Tensor, (d, a))
    graph.output(e)
    return graph, [a, b, c, d, e]


def test_ancestors_stop_at_and_include_the_stop_nodes() -> None:
    _, (a, b, c, d, e) = _chain()
    assert ancestors([e], set()) == {a, b, c, d, e}
    assert ancestors([e], {c}) == {a, c, d, e}  # b is behind c
    assert ancestors([e, 3.0], {d, a}) == {a, d, e}  # non-nodes among the roots are skipped


def test_source_line_falls_back_to_the_producer_of_a_tuple_item() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    op = graph.call_function(aten.var_mean.correction, (x,))
    item = graph.call_function(operator.getitem, (op, 0))
    op.meta["custom"] = {"remat_source": "model.py:7"}
    assert source_line(item) == "model.py:7" and source_line(x) is None


def test_written_arguments_and_defaults_read_as_the_schema_text_says() -> None:
    for op in (aten.add_.Tensor, aten.add.Tensor, aten.index_put_.default, aten.native_batch_norm.default,
               aten.sum.dim_IntList, aten.normal_.default):
        text = str(op._schema)
        arguments = text[text.index("(") + 1: text.rindex(") ->")].split(", ")
        written = tuple((i, a.split(" ")[-1].split("=")[0]) for i, a in enumerate(a for a in arguments if a != "*") if "!" in a)
        assert written_arguments(op) == written, text
        positional, keyword = schema_defaults(op)
        kw_only = arguments.index("*") if "*" in arguments else len(arguments)
        for i, argument in enumerate(arguments[:kw_only]):
            assert (positional[i] is NO_DEFAULT) == ("=" not in argument), (text, argument)
        assert set(keyword) == {a.split(" ")[-1].split("=")[0] for a in arguments[kw_only + 1:] if "=" in a}, text


def test_split_call_finds_every_tensor_by_path_and_rebuilds_the_call() -> None:
    w = torch.randn(2, dtype=D)

    def fn(x: Any, config: Any, scale: float = 1.0) -> Any:
        return x["a"] * w * scale

    x = {"a": torch.randn(2, dtype=D), "rest": [torch.randn(3, dtype=D), 4]}
    call = split_call(fn, ("x", "config", "scale"), (x, "relu"), {"scale": 2.0}, frozenset(), frozenset())
    assert list(call.tensor_paths) == ["x['a']", "x['rest'][0]"]
    assert all(a is b for a, b in zip(call.tensors, [x["a"], x["rest"][0]]))
    assert list(call.captured_paths) == ["w"] and call.captured[0] is w
    args, kwargs = call.rebuild(call.tensors)
    assert args[0]["a"] is x["a"] and args[0]["rest"][1] == 4 and args[1] == "relu" and kwargs == {"scale": 2.0}


def test_the_call_key_changes_with_what_a_trace_depends_on_and_only_that() -> None:
    def fn(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    def key(*args: Any) -> Any:
        return split_call(fn, ("x", "n"), args, {}, frozenset(), frozenset()).key

    x = torch.randn(2, 3, dtype=D)
    base = key(x, 2)
    assert base == key(torch.randn(2, 3, dtype=D), 2)  # values do not matter
    with torch.no_grad():
        grad_off = key(x, 2)
    different = [key(x.float(), 2), key(x.t(), 2), key(torch.randn(3, 3, dtype=D), 2), key(x, 3),
                 key(x.detach().requires_grad_(), 2), grad_off]
    assert all(k != base for k in different) and len(set(different)) == len(different)


def test_the_pairwise_cover_holds_every_pair_of_any_two_axes() -> None:
    axes = [list("abcd"), list("xyz"), list("0123456")]
    cover = pairwise_cover(*axes)
    for (i, a), (j, b) in itertools.combinations(enumerate(axes), 2):
        assert {(c[i], c[j]) for c in cover} == set(itertools.product(a, b))
    assert len(cover) < len(list(itertools.product(*axes)))


def test_index_fill_as_where_gives_the_same_values_and_batches_under_vmap() -> None:
    """The pass against the op it replaces: the same values, and under vmap with a batched
    value and an unbatched target, what eager gives for each value one at a time."""
    from remat._trace.passes import check_invariants, index_fill_as_where

    def fn(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return torch.index_fill(x, 1, torch.tensor([0, 2]), value)

    x, value = torch.randn(3, 4, dtype=D), torch.tensor(2.5, dtype=D)
    gm = make_fx(fn, tracing_mode="fake")(x, value)
    assert any(n.target is aten.index_fill.int_Tensor for n in gm.graph.nodes)
    index_fill_as_where(gm.graph, list(gm.graph.nodes))
    gm.recompile()
    assert not any(n.target is aten.index_fill.int_Tensor for n in gm.graph.nodes)
    check_invariants(gm)
    assert_close(gm(x, value), fn(x, value))
    values = torch.randn(5, dtype=D)
    assert_close(torch.vmap(gm, in_dims=(None, 0))(x, values), torch.stack([fn(x, v) for v in values]))


def test_the_invariant_check_finds_an_in_place_op() -> None:
    """check_invariants, which every graph of the suite passes, fails where it should."""
    import pytest

    from remat._trace.passes import check_invariants

    gm = make_fx(lambda x: x.clone().mul_(2), tracing_mode="fake")(torch.randn(3))
    with pytest.raises(AssertionError, match="not functional"):
        check_invariants(gm)


def test_a_form_check_says_what_comparing_forms_says() -> None:
    """`form_check(form)(value)` is `value_form(value) == form` for every pair of a set of
    values read from modules: atoms, floats, the region's own modules and tensors, empty and
    filled tables, nested containers, containers nested past the depth limit, and objects
    (the same one, another one, one that became a place or an empty table)."""
    from collections import OrderedDict

    from remat._trace.attribute_reads import form_check, value_form

    linear = torch.nn.Linear(2, 2)
    places = {id(linear): ("module", "lin"), id(linear.weight): ("tensor", "lin.weight")}
    shared, other, deep = object(), object(), [[[[[1]]]]]
    values: list[Any] = [
        True, 1, 0, "a", "b", None, torch.float32, torch.device("cpu"), 0.5, -0.0, 0.0, float("nan"),
        linear, linear.weight, linear.bias, {}, [], (), OrderedDict(), {"a": 1}, OrderedDict(w=linear.weight),
        OrderedDict(w=linear.bias), [1, (2, "x")], [1, (2, "y")], (linear,), deep, [[[[[2]]]]], shared, other, {1, 2},
    ]
    kept: list[Any] = []
    forms = [value_form(v, places, kept) for v in values]
    for form in forms:
        check = form_check(form)
        for value, value_form_now in zip(values, forms, strict=True):
            assert check(value, places, kept) == (value_form_now == form), (form, value)
    # the same object, later a place of the region, or emptied past the depth limit
    check = form_check(value_form(shared, places, kept))
    assert not check(shared, {**places, id(shared): ("module", "x")}, kept)
    nested = [[[[[{"k": 1}]]]]]
    inner = nested[0][0][0][0][0]
    check = form_check(value_form(inner, places, kept, depth=4), depth=4)
    inner.clear()
    assert not check(inner, places, kept)


# backward-shaped functions of (a value, the incoming gradient), each with whether a
# broadcast gradient may enter it as it is
_BACKWARDS: dict[str, tuple[Any, bool]] = {
    "pointwise, then a matrix product": (lambda y, g: torch.ops.aten.tanh_backward(g, y) @ y.t(), True),
    "a transpose, then a matrix product": (lambda y, g: g.t() @ y, True),
    "a view, then pointwise": (lambda y, g: g.view(12).sin() * y.reshape(12), True),
    "pointwise with a transposed operand": (lambda y, g: g * y.t().contiguous().t(), False),
    "as_strided": (lambda y, g: torch.as_strided(g, (3, 2), (1, 3)) * 2, False),
    "the gradient returned": (lambda y, g: g, False),
    "a reduction": (lambda y, g: g.sum(0) * y, True),
    "a reduction, then pointwise with a transposed operand": (
        lambda y, g: g.sum(0, keepdim=True) * y.t().contiguous().t(), True
    ),
}


def test_a_broadcast_gradient_enters_as_is_only_where_every_result_is_as_with_a_contiguous_one() -> None:
    """`broadcast_tangents` against running each graph: where it lets a broadcast
    gradient (every stride 0) in as it is, every result is laid out as with the gradient's
    contiguous copy, with its values (a sum may round otherwise, as eager's does); every
    graph it refuses here would lay a result out otherwise, raise (`as_strided` past the
    broadcast tensor's one element) or return the gradient itself."""
    from remat._running.layouts import broadcast_tangents

    y = torch.randn(3, 4)
    broadcast = torch.randn(()).expand(3, 4)
    for name, (fn, allowed) in _BACKWARDS.items():
        gm = make_fx(fn, tracing_mode="fake")(y, torch.randn(3, 4))
        assert broadcast_tangents(gm, 1) == (frozenset({0}) if allowed else frozenset()), name
        copied = gm(y, broadcast.contiguous())
        try:
            as_is = gm(y, broadcast)
        except RuntimeError:  # as_strided past the broadcast tensor's one element
            as_is = None
        same = as_is is not None and as_is is not broadcast and as_is.stride() == copied.stride()
        assert same == allowed, name
        if allowed:
            torch.testing.assert_close(as_is, copied)
