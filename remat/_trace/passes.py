"""Named rewrites of traced graphs, each keeping the graph's meaning and the invariants
that every graph remat runs must have:

- functional: no op writes in place (no aliasing write), except the trailing `copy_`
  of a mutated input that stage 1 turns into an output;
- vmap-safe: no op whose result would be batched differently under vmap than the same
  code without remat (in place writes, random fills of batched tensors);
- layouts as traced: every node's example value carries the strides its op produces.

`check_invariants` checks the first two on any graph; the tests run it on every graph the
suite builds.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence

import torch
import torch.fx

from .._core.nodes import (
    AUTOCAST_CAST_KEY,
    BACKWARD_KEY,
    FILL_LIKE_KEY,
    FILL_PERMUTED_KEY,
    GRAD_OFF_KEY,
    NO_DEFAULT,
    USER_DETACH_KEY,
    ancestors,
    comes_after,
    is_tuple,
    is_view,
    schema_defaults,
    written_arguments,
)
from .._core.ops import VALUE_WITH_GRAD_OF
from .._core.torch_internals import OpOverload, graph_module, new_fake_mode

_aten = torch.ops.aten

# In-place random fills and their functional forms, which draw the same numbers in logical
# order into a new contiguous tensor (torch 2.13).
_RANDOM_FILLS = {
    _aten.bernoulli_.float: _aten.bernoulli.p,
    _aten.bernoulli_.Tensor: _aten.bernoulli.Tensor,
    _aten.uniform_.default: _aten.uniform.default,
    _aten.normal_.default: _aten.normal_functional.default,
    _aten.exponential_.default: _aten.exponential.default,
    _aten.cauchy_.default: _aten.cauchy.default,
    _aten.log_normal_.default: _aten.log_normal.default,
    _aten.geometric_.default: _aten.geometric.default,
    **{getattr(_aten.random_, name): getattr(_aten.random, name) for name in _aten.random_.overloads()},
}


_FUNCTIONAL_FILLS = set(_RANDOM_FILLS.values())
_RANDOM_FROM = getattr(_aten.random, "from")  # a Python keyword


_RANDOM_LIKES = frozenset(
    getattr(op, name) for op in (_aten.rand_like, _aten.randn_like, _aten.randint_like) for name in op.overloads()
    if "out" not in name
)


def random_likes_in_traced_layout(gm: torch.fx.GraphModule) -> None:
    """Before functionalization: `rand_like(x)` lays its draw out as `x` is laid out in memory
    (preserve_format), and draws in memory order. Functionalization may give `x` other
    strides than eager code's (a value changed in place through a transposed view comes
    back as a scatter into that view, transposed under vmap), which puts the same numbers on
    other elements. So the layout eager code drew into, read from the trace, is written on
    the op: contiguous or channels_last (any other layout is left as it is)."""
    for node in gm.graph.nodes:
        if node.target not in _RANDOM_LIKES or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.layout is not torch.strided:
            continue
        for layout in (torch.contiguous_format, torch.channels_last):
            if (layout is torch.contiguous_format or val.dim() == 4) and val.is_contiguous(memory_format=layout):
                node.kwargs = {**node.kwargs, "memory_format": layout}
                break


def random_fills_in_memory_order(gm: torch.fx.GraphModule) -> None:
    """Before functionalization: a random fill of a fresh tensor (`empty_like(x).bernoulli_(p)`,
    as dropout and SDPA's dropout on CPU do; or of any value the function computed, which
    it overwrites whole, as `(x * 1).bernoulli_(p)`) draws in the tensor's memory order; its
    functional form draws in logical order into a contiguous tensor, which puts the same
    numbers on other elements when `x` is not contiguous. So draw into a contiguous tensor
    laid out as the fresh one is in memory, and permute it to the logical order: the same
    values as eager, a graph without the in-place fill, and under vmap a draw batched as
    the random mode says (a batched `empty_like` filled out of place is refused for `same`).

    Eager autograd keeps a filled value that carries a gradient on the graph, with a zero
    derivative: its inputs get zero gradients, not None, and a gradient of a gradient reaches
    them through it too. The draw then stands behind `where(True, draw, filled)`, which
    differentiates so and rounds nothing (computing `filled` as eager code does)."""
    graph = gm.graph
    for node in list(graph.nodes):
        functional = _RANDOM_FILLS.get(node.target)  # type: ignore[call-overload]
        filled = node.args[0] if functional is not None else None
        if not isinstance(filled, torch.fx.Node) or filled.op != "call_function" or is_view(filled) or any(
            is_view(u) for u in filled.users if u is not node
        ):
            continue  # a fill of an input, a view or a viewed tensor writes memory others read: functionalization's
        val = filled.meta["val"]
        order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), -val.shape[d]))  # outermost first
        physical = [val.shape[d] for d in order]
        inverse = sorted(range(val.dim()), key=order.__getitem__)
        later = [u for u in filled.users if u is not node and comes_after(graph, u, node)]
        with graph.inserting_before(node):
            fresh = graph.call_function(
                _aten.empty.memory_format,
                (physical,),
                {"dtype": val.dtype, "layout": torch.strided, "device": val.device, "pin_memory": False},
            )
            drawn = graph.call_function(functional, (fresh, *_positional_with_defaults(node)[1:]), dict(node.kwargs))  # type: ignore[arg-type]
            logical = graph.call_function(_aten.permute.default, (drawn, inverse))
        fresh.meta = {**filled.meta, "val": val.new_empty(physical)}
        drawn.meta = {**node.meta, "val": fresh.meta["val"]}
        # see _running/executing.eager_under_transforms
        drawn.meta["custom"] = {
            **drawn.meta.get("custom", {}), FILL_LIKE_KEY: True, FILL_PERMUTED_KEY: order != sorted(order),
        }
        logical.meta = {**node.meta, "val": fresh.meta["val"].permute(inverse)}
        result = _with_zero_derivative_into(graph, logical, filled) if _may_carry_gradient(filled, node) else logical
        node.replace_all_uses_with(result)
        for user in later:
            user.replace_input_with(filled, result)
        graph.erase_node(node)
        if not filled.users:
            graph.erase_node(filled)
    graph.lint()


# ops whose result autograd never tracks, which a random fill of a fresh tensor fills
_FACTORIES = frozenset({
    _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided, _aten.zeros,
    _aten.zeros_like, _aten.new_zeros, _aten.ones, _aten.ones_like, _aten.new_ones, _aten.full, _aten.full_like,
    _aten.new_full,
})


def _may_carry_gradient(filled: torch.fx.Node, fill: torch.fx.Node) -> bool:
    """Whether eager autograd may track `filled` through its fill: a floating value the
    function computed from its inputs (not a factory's), filled with grad enabled."""
    value = filled.meta["val"]
    if not (value.is_floating_point() or value.is_complex()) or fill.meta.get("custom", {}).get(GRAD_OFF_KEY):
        return False
    if getattr(filled.target, "overloadpacket", None) in _FACTORIES:
        return False
    return any(n.op == "placeholder" for n in ancestors([filled], set()))


def _with_zero_derivative_into(graph: torch.fx.Graph, value: torch.fx.Node, filled: torch.fx.Node) -> torch.fx.Node:
    """`where(True, value, filled)`, right after `value`: `value`, and a zero gradient for `filled`."""
    with graph.inserting_after(value):
        device = value.meta["val"].device
        true = graph.call_function(_aten.full.default, ([], True), {"dtype": torch.bool, "device": device})
    with graph.inserting_after(true):
        edge = graph.call_function(_aten.where.self, (true, value, filled))
    true.meta = {**value.meta, "val": value.meta["val"].new_full((), True, dtype=torch.bool)}
    edge.meta = {**value.meta, "val": torch.where(true.meta["val"], value.meta["val"], filled.meta["val"])}
    return edge


def autocast_casts_of_leaves_cached(gm: torch.fx.GraphModule, leaves: Sequence[bool]) -> None:
    """Eager autocast keeps one cast to its low dtype of a float32 leaf that requires grad
    (a parameter; a transform's input) while an autocast context is open (its cast cache;
    make_fx traces with the cache off): every use reads that cast, whose gradient sums all
    uses in the low dtype before one cast back. So the casts autocast made of each such
    input of the graph (`leaves`: per placeholder) in one lifetime of the cache (the
    number AUTOCAST_CAST_KEY holds; 0 with the cache off) become the first one, for the
    same gradient, rounded the same. A cast made with grad disabled is not one of them: eager
    code's later casts with grad on do not read it (they are differentiable)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for placeholder, leaf in zip(placeholders, leaves):
        value = placeholder.meta.get("val")
        if not leaf or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            continue
        first: dict[Any, torch.fx.Node] = {}
        for user in list(placeholder.users):
            custom = user.meta.get("custom", {})
            lifetime = custom.get(AUTOCAST_CAST_KEY)
            if user.target is not _aten._to_copy.default or not lifetime or custom.get(GRAD_OFF_KEY):
                continue
            if user.kwargs.get("dtype") not in (torch.bfloat16, torch.float16):
                continue
            key = (lifetime, tuple(sorted(user.kwargs.items())))
            if key in first:
                user.replace_all_uses_with(first[key])
                graph.erase_node(user)
            else:
                first[key] = user
    graph.lint()


def grad_free_values_as_constants(gm: torch.fx.GraphModule) -> None:
    """A value the function computes with grad disabled (`no_grad`, `inference_mode`,
    `set_grad_enabled(False)`) is a constant of backward in eager code. Stage 2 replays the
    graph with grad on, so each such value is detached where code running with grad on (or
    the output) reads it: no gradient flows into or through it, as in eager. (A read that is
    a detach already needs none.)"""
    graph = gm.graph
    for node in list(graph.nodes):
        custom = node.meta.get("custom", {})
        if node.op != "call_function" or not custom.get(GRAD_OFF_KEY) or is_tuple(node):
            continue
        outside = [
            u for u in node.users
            if u.op == "output" or not (u.meta.get("custom", {}).get(GRAD_OFF_KEY) or u.target is _aten.detach.default)
        ]
        if not outside:
            continue
        with graph.inserting_after(node):
            constant = graph.call_function(_aten.detach.default, (node,))
        rest = {k: v for k, v in custom.items() if k != GRAD_OFF_KEY}
        constant.meta = {**node.meta, "custom": {**rest, USER_DETACH_KEY: True}}
        for user in outside:
            user.replace_input_with(node, constant)
    graph.lint()


def grad_free_write_as_value_with_grad(
    graph: torch.fx.Graph,
    write: torch.fx.Node,
    written: torch.fx.Node,
    aliases: Sequence[torch.fx.Node],
    later: Sequence[torch.fx.Node],
) -> torch.fx.Node:
    """Before functionalization: `write` changes `written` in place with grad disabled, and
    `later` read it (through `aliases`, the results of in-place ops on it) afterwards. They read instead the new values with the gradient of the
    tensor as it was before the write (copied before it, a value autograd tracks), as
    eager autograd differentiates them; returns the node they read."""
    custom = {k: v for k, v in write.meta.get("custom", {}).items() if k != GRAD_OFF_KEY}
    with graph.inserting_before(write):
        before = graph.call_function(_aten.clone.default, (written,))
    with graph.inserting_after(write):
        after = graph.call_function(VALUE_WITH_GRAD_OF, (written, before))
    for new in (before, after):
        new.meta = {"custom": dict(custom)}
        if "val" in written.meta:
            new.meta["val"] = written.meta["val"].clone()
    for reader in later:
        for alias in aliases:
            reader.replace_input_with(alias, after)
    return after


def inner_backwards_as_eager(gm: torch.fx.GraphModule) -> None:
    """A function may run torch.autograd.grad itself (a gradient penalty). Traced, its
    backward is plain ops, and autograd's own plumbing shows as `detach`es; so that the
    graph is differentiated as eager code is:
    - with create_graph=True, the detaches autograd puts around saved values are aliases
      (eager's double backward differentiates through them); a user's `detach` stays;
    - without it, the gradients are constants: a detach goes where they leave the backward."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        custom = node.meta.get("custom", {})
        builds_graph = custom.get(BACKWARD_KEY)
        if builds_graph is False:
            outside = [u for u in node.users if u.meta.get("custom", {}).get(BACKWARD_KEY) is None and u.op != "output"]
            outside += [u for u in node.users if u.op == "output"]
            if outside:
                with graph.inserting_after(node):
                    constant = graph.call_function(_aten.detach.default, (node,))
                constant.meta = {**node.meta, "custom": {k: v for k, v in custom.items() if k != BACKWARD_KEY}}
                for user in outside:
                    user.replace_input_with(node, constant)
        elif node.target is _aten.detach.default and not custom.get(USER_DETACH_KEY):
            readers = [u.meta.get("custom", {}).get(BACKWARD_KEY) for u in node.users]
            if builds_graph or (readers and all(r is True for r in readers)):
                node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
                graph.erase_node(node)
    graph.lint()


def random_from_as_random_to(gm: torch.fx.GraphModule) -> None:
    """After functionalization: `random.from` (what `random_(low, high)` becomes) is an
    overload Python cannot name in generated code (`from` is a keyword); it draws as
    `random.to` into int64 plus `low` instead: the same numbers from the same draws (the
    kernel adds `low` in int64 too), then cast."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _RANDOM_FROM and argument(node, 2, None) is not None:
            _random_from_as_random_to(graph, node)
    graph.lint()


def _random_from_as_random_to(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    low, high = argument(node, 1, None), argument(node, 2, None)
    val = node.meta["val"]
    filled = node.args[0]
    with graph.inserting_before(node):
        if isinstance(filled, torch.fx.Node) and filled.target is _aten.empty.memory_format:  # fresh, contiguous
            options = {**filled.kwargs, "dtype": torch.int64}
            wide = graph.call_function(_aten.empty.memory_format, filled.args, options)
        else:
            wide = graph.call_function(_aten.empty_like.default, (filled,), {"dtype": torch.int64})
        drawn = graph.call_function(_aten.random.to, (wide, high - low), {k: v for k, v in node.kwargs.items() if k == "generator"})
        shifted = graph.call_function(_aten.add.Scalar, (drawn, low))
        cast = graph.call_function(_aten._to_copy.default, (shifted,), {"dtype": val.dtype})
    for new in (wide, drawn, shifted):
        new.meta = {**node.meta, "val": val.to(torch.int64)}
    cast.meta = dict(node.meta)
    node.replace_all_uses_with(cast)
    graph.erase_node(node)


def rrelu_as_product(gm: torch.fx.GraphModule) -> None:
    """rrelu in training draws a slope per element into `noise` and returns `x * noise`.
    The derivative of its functional form reads the noise it was given, not the one it
    drew (zero gradients, torch 2.13), so its output becomes that product here: the same
    values, differentiated by autograd."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not _aten.rrelu_with_noise_functional.default or not argument(node, 4, False):
            continue
        with graph.inserting_after(node):
            noise = graph.call_function(operator.getitem, (node, 1))
        with graph.inserting_after(noise):
            product = graph.call_function(_aten.mul.Tensor, (node.args[0], noise))
        noise.meta = {**node.meta, "val": node.meta["val"][1]}
        product.meta = {**node.meta, "val": node.meta["val"][0]}
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(product)
                graph.erase_node(user)
    graph.lint()


# Ops that read only the shape, dtype, device and layout of their tensor argument.
_SHAPE_ONLY = {
    _aten.zeros_like.default: 0.0,
    _aten.ones_like.default: 1.0,
    _aten.empty_like.default: 0.0,
    _aten.new_zeros.default: 0.0,
    _aten.new_ones.default: 1.0,
    _aten.new_empty.default: 0.0,
}


def shape_only_factories(
    graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node], readers: set[torch.fx.Node] | None = None
) -> None:
    """`zeros_like(x)` in backward would keep `x` alive for its shape: build the same
    tensor (shape, dtype, strides as traced) from constants instead. Out of place, so an
    unbatched factory meets batched values only in ops that broadcast (vmap-safe).
    With `readers`, only those read the new tensor (a forward factory that backward reads
    is then made again in backward, instead of keeping `x` or the factory's output)."""
    for node in nodes:
        fill = _SHAPE_ONLY.get(node.target)  # type: ignore[call-overload]
        if fill is None or (readers is not None and not any(user in readers for user in node.users)):
            continue
        with graph.inserting_before(node):
            new = _filled(graph, node, fill, node.meta["val"].dtype)
        if readers is None:
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        else:
            node.replace_all_uses_with(new, delete_user_cb=readers.__contains__)


def index_fill_as_where(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> None:
    """`index_fill(x, dim, index, value)` with a tensor `value`, as derivatives (trace's)
    write it in place, becomes `where(mask, value, x)`: the same values, and vmap batches
    it correctly (torch 2.13's batching rule for the out-of-place op ignores a batched
    value when `x` is not batched)."""
    for node in nodes:
        if node.op != "call_function" or node.target is not _aten.index_fill.int_Tensor:
            continue
        target, dim, index, value = node.args[:4]
        val = node.meta["val"]
        with graph.inserting_before(node):
            nothing = _filled(graph, node, False, torch.bool)
            mask = graph.call_function(_aten.index_fill.int_Scalar, (nothing, dim, index, True))
            cast = graph.call_function(_aten._to_copy.default, (value,), {"dtype": val.dtype})
            where = graph.call_function(_aten.where.self, (mask, cast, target))
        mask.meta = dict(nothing.meta)
        cast.meta = {**node.meta, "val": value.meta["val"].to(val.dtype)}  # type: ignore[union-attr]
        where.meta = dict(node.meta)
        node.replace_all_uses_with(where)
        graph.erase_node(node)


def _empty_like_traced(graph: torch.fx.Graph, like: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """A new `empty_strided` node with `like`'s traced shape, strides and device."""
    val = like.meta["val"]
    empty = graph.call_function(
        _aten.empty_strided.default,
        (list(val.shape), list(val.stride())),
        {"dtype": dtype, "layout": torch.strided, "device": val.device, "pin_memory": False},
    )
    empty.meta = {**like.meta, "val": val.new_empty_strided(val.shape, val.stride(), dtype=dtype)}
    return empty


def _filled(graph: torch.fx.Graph, like: torch.fx.Node, value: Any, dtype: torch.dtype) -> torch.fx.Node:
    """New nodes making a tensor laid out as `like` was traced, filled with `value`."""
    filled = graph.call_function(_aten.fill.Scalar, (_empty_like_traced(graph, like, dtype), value))
    filled.meta = dict(filled.args[0].meta)  # type: ignore[union-attr]
    return filled


_ACCUMULATIONS = (_aten.add.Tensor,)  # how autograd sums gradient contributions


def without_absent_cotangents(
    gm: torch.fx.GraphModule, cotangents: Sequence[torch.fx.Node], absent: Sequence[torch.fx.Node]
) -> torch.fx.GraphModule:
    """A backward graph where the cotangent placeholders `absent` (among `cotangents`) are
    no gradient at all, as in eager autograd, rather than zeros (an unused output's zero
    times an infinite derivative would be NaN). A backward is linear in its cotangents, so
    a value computed only from absent ones is nothing and is not computed; one that also
    reads present ones gets zeros in their place (a sum just drops the term, as autograd's
    does); a gradient computed from none is None, as eager autograd leaves it."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nothing = set(absent)  # values that are no gradient
    derived = set(cotangents)  # values computed from cotangents
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node)
        elif node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], lambda n: None if n in nothing else env[n]))  # type: ignore[arg-type,return-value]
        elif not any(n in derived for n in node.all_input_nodes):
            env[node] = graph.node_copy(node, env.__getitem__)
        else:
            derived.add(node)
            read = [n for n in node.all_input_nodes if n in derived]
            if all(n in nothing for n in read):
                nothing.add(node)
                continue
            terms = [a for a in node.args if a not in nothing]
            if node.target in _ACCUMULATIONS and len(node.args) == 2 and not node.kwargs and len(terms) == 1:
                env[node] = env[terms[0]]  # type: ignore[index]
                continue
            zeros = {n: _filled(graph, n, 0, n.meta["val"].dtype) for n in read if n in nothing}
            env[node] = graph.node_copy(node, lambda n: zeros[n] if n in zeros else env[n])
    graph.eliminate_dead_code()
    return graph_module(gm, graph)


def drop_saved_value_detaches(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> None:
    """Autograd unpacks a saved output through `detach` when traced; for second-order
    gradients the backward must read the value itself, as autograd's own double backward
    does. (A user's `detach` is a forward node and stays.) Keeps every invariant: a detach
    is a view of the same value."""
    for node in nodes:
        if node.op == "call_function" and node.target is _aten.detach.default:
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            graph.erase_node(node)


def read_mutated_inputs_from_copies(graph: torch.fx.Graph, mutated: Sequence[torch.fx.Node]) -> set[torch.fx.Node]:
    """Make every reader of a mutated input read a copy taken before the update (which
    happens after the forward); the copies must be kept, since recomputing one in backward
    would copy the updated value. Returns the copies."""
    copies = set()
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for placeholder in mutated:
        with graph.inserting_after(anchor):  # a copy with the input's very strides: later views stay as traced
            empty = _empty_like_traced(graph, placeholder, placeholder.meta["val"].dtype)
        with graph.inserting_after(empty):
            copy = graph.call_function(_aten.copy.default, (empty, placeholder))
        copy.meta = {**placeholder.meta, "val": empty.meta["val"]}
        placeholder.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)  # type: ignore[misc]
        copies.add(copy)
    return copies


def _positional_with_defaults(node: torch.fx.Node) -> list[Any]:
    """The node's positional arguments, with the defaults that tracing left out filled in
    (the functional twin of an op may have no default where the in-place op had one)."""
    defaults, _ = schema_defaults(node.target)  # type: ignore[arg-type]
    names = [a.name for a in node.target._schema.arguments if not a.kwarg_only]  # type: ignore[union-attr]
    left_out = zip(names[len(node.args):], defaults[len(node.args):])
    return [*node.args, *(None if d is NO_DEFAULT else d for name, d in left_out if name not in node.kwargs)]


def argument(node: torch.fx.Node, position: int, default: Any) -> Any:
    """An op node's argument by schema position, given positionally, by name or not at all."""
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(node.target._schema.arguments[position].name, default)  # type: ignore[union-attr]


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether an op node writes one of its arguments (its schema says so)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    return bool(written_arguments(node.target))


def check_invariants(gm: torch.fx.GraphModule, allow_input_copies: bool = False) -> None:
    """Raise AssertionError naming the node when `gm` breaks an invariant of this module.

    With `allow_input_copies`, a `copy_` into a graph input is allowed (stage 1, before the
    mutated inputs become outputs)."""
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if writes_in_place(node):
            if allow_input_copies and node.target is _aten.copy_.default and node.args[0] in placeholders:
                continue
            raise AssertionError(f"not functional: {node.format_node()}")
        if node.op == "call_function" and node.target in _FUNCTIONAL_FILLS:
            filled = node.args[0]
            while isinstance(filled, torch.fx.Node) and filled.target is _aten.expand.default:
                filled = filled.args[0]
            if not (isinstance(filled, torch.fx.Node) and filled.target is _aten.empty.memory_format):
                raise AssertionError(f"not vmap-safe, a random fill of a computed tensor: {node.format_node()}")
    gm.graph.lint()


def writes_out_of_place(gm: torch.fx.GraphModule) -> bool:
    """Before functionalization: each in-place write to a fresh value nothing aliases
    (`a.sub_(b)` where `a` is an op's own result, read by no view, written once, as
    autograd's formulas do) becomes its out-of-place twin, and the readers after the write
    read the twin. True when no write is left, so the whole-graph functionalizing retrace
    can be skipped; False, with the graph untouched, when any write is of another kind."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    twins = []
    for node in gm.graph.nodes:
        if writes_in_place(node):
            twin = _out_of_place_twin(node)
            if twin is None:
                return False
            twins.append((node, twin))
    for node, twin in twins:
        written = node.args[0]
        for user in list(written.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(written, node)
        node.target = twin
    gm.graph.lint()
    gm.recompile()
    return True


def _out_of_place_twin(node: torch.fx.Node) -> Any:
    """`aten.X.overload` for a node `aten.X_.overload(a, ...)` that writes only `a`, when `a`
    is fresh and unaliased and the twin gives a value laid out as `a` (no type promotion,
    same strides); else None."""
    op = node.target
    schema = op._schema  # type: ignore[union-attr]
    if not (schema.name.startswith("aten::") and schema.name.endswith("_")) or [i for i, _ in written_arguments(op)] != [0]:
        return None
    if torch.Tag.nondeterministic_seeded in op.tags:  # type: ignore[union-attr]
        return None  # random fills have their own pass
    if op is _aten.copy_.default:
        return None  # aten.copy has no derivative: functionalizing replaces it with a differentiable form
    packet = getattr(_aten, schema.name[len("aten::"):-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None  # type: ignore[union-attr]
    if twin is None or twin._schema.is_mutable or [a.name for a in twin._schema.arguments] != [a.name for a in schema.arguments]:
        return None
    target = node.args[0]
    if not isinstance(target, torch.fx.Node) or target.op != "call_function" or is_view(target):
        return None
    if any(is_view(user) or (writes_in_place(user) and user is not node) for user in target.users):
        return None  # an alias would see the write, or a second write
    value, before = _value_on_fakes(node, twin), target.meta.get("val")
    if not (isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) and _same_layout(value, before)):
        return None
    return twin


def _value_on_fakes(node: torch.fx.Node, op: Any) -> Any:
    """What `op` gives for the node's recorded arguments, on fake tensors (None if they
    cannot stand for them)."""
    mode = new_fake_mode()

    def fake(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                with mode:
                    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
            return val
        return value

    try:
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), fake)
        with mode:
            return op(*args, **kwargs)
    except Exception:  # an argument fake tensors cannot stand for
        return None


def _same_layout(value: torch.Tensor, recorded: torch.Tensor) -> bool:
    same = value.shape == recorded.shape and value.dtype == recorded.dtype
    return same and all(n == 1 or a == b for n, a, b in zip(value.shape, value.stride(), recorded.stride()))


def check_layouts(gm: torch.fx.GraphModule) -> None:
    """Raise AssertionError naming the node when an op node's recorded value (shape, dtype,
    strides) is not what the op gives, on fake tensors, for its recorded inputs: a rewrite
    that built a node with the wrong metadata would make the graph run otherwise than traced."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        recorded = node.meta.get("val")
        if not isinstance(recorded, torch.Tensor) or recorded.layout != torch.strided:  # sparse: no strides
            continue
        value = _value_on_fakes(node, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        same = _same_layout(value, recorded)
        if not same and value.numel():
            raise AssertionError(
                f"layout not as traced: {node.format_node()} records {recorded.dtype}{list(recorded.shape)} "
                f"strides {list(recorded.stride())}, the op gives {value.dtype}{list(value.shape)} strides {list(value.stride())}"
            )
