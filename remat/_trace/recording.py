"""A light tracer: the graph make_fx would make, recorded op by op.

make_fx spends most of a trace in its general machinery (pytree round trips, proxy
objects, constant propagation, symbolic sizes): for a Llama layer's 220-node joint, 99 ms
where running the same ops on the same fake tensors takes 26. remat's traces need little
of it: their inputs are fake tensors of concrete sizes and every tensor they meet is one
of them, an op's output, or a real constant. `record` makes the graph make_fx would make
(the same nodes, names, arguments and meta, "tensor_meta" aside) by recording each aten op
as it runs. Anything else make_fx handles (a symbolic size, a data-dependent op, a tensor
subclass, a custom or higher-order op) raises `Unrecordable`, and the caller traces with
make_fx instead; so does any error, so errors are make_fx's own.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from .._core.nodes import NO_DEFAULT, schema_defaults
from .._core.torch_internals import (
    FakeTensor,
    active_dispatch_modes,
    autograd_would_decompose,
    dispatch_modes_active,
    fake_device,
    graph_module,
    make_fx_like_settings,
    meta_value,
    original_aten_op,
    tracing_node,
    unwrap_transforms,
)

aten = torch.ops.aten

# Ops make_fx treats specially (data-dependent values, sizes): left to it.
_LEFT_TO_MAKE_FX = frozenset({
    aten.is_nonzero.default,
    aten.sym_size.int, aten.sym_size.default, aten.sym_stride.int, aten.sym_stride.default,
    aten.sym_storage_offset.default, aten.sym_numel.default,
})
# make_fx evaluates a data-dependent op on constants, and notes the input values of an op
# that needs exact strides ("eager_input_vals"): left to it too.
_LEFT_TO_MAKE_FX_TAGS = frozenset({torch.Tag.data_dependent_output, torch.Tag.needs_exact_strides})
# The ops recorded: their kernels and derivatives are C++. A custom op's are Python
# (torch.library), which may treat a user dispatch mode unlike make_fx's:
# linear_cross_entropy's derivative records an extra `detach` per buffer it allocates.
_RECORDED_NAMESPACES = frozenset({"aten", "prims"})
# The non-tensor arguments a node holds as they are, as make_fx does.
_LITERALS = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


class Unrecordable(Exception):
    """The function does something the recorder leaves to make_fx."""


class _OpRecorder(TorchDispatchMode):
    """Appends each aten op run under it to `graph`, its tensor arguments replaced by the
    nodes that made them."""

    def __init__(self, graph: torch.fx.Graph, root: torch.nn.Module) -> None:
        super().__init__()
        self.graph = graph
        self.root = root  # holds the real tensor constants the graph reads, as make_fx's root does
        self.appender = torch.fx.proxy.GraphAppendingTracer(graph)  # node meta as make_fx's tracer copies it
        # id of a tensor -> (a weak reference to it, the node whose value it is). Weak, as
        # make_fx's: a strong one would make torch's factory functions (`torch.zeros_like`)
        # see their result shared and return a detached copy, an extra `detach` op.
        self.nodes: dict[int, tuple[weakref.ref[torch.Tensor], torch.fx.Node]] = {}
        self.constants: dict[int, str] = {}  # id of a real tensor -> its attribute on `root`
        self.decomposes: dict[tuple[int, str | None], bool] = {}
        # Told the nodes of each op run at this mode's level (not those of the decompositions
        # it runs below), as a mode above it would see them (`reporting_ops`).
        self.report: Callable[[list[torch.fx.Node | None], list[torch.Tensor]], None] | None = None
        self.depth = 0  # ops being recorded, one inside another (decompositions)

    @contextlib.contextmanager
    def reporting_ops(self, report: Callable[[list[torch.fx.Node | None], list[torch.Tensor]], None]) -> Iterator[None]:
        """Within: `report` gets each op's tensor outputs and their nodes, what a dispatch
        mode entered above this one would see, without the cost of another mode on every op."""
        previous, self.report = self.report, report
        try:
            yield
        finally:
            self.report = previous

    def node_of(self, t: torch.Tensor) -> torch.fx.Node | None:
        entry = self.nodes.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None  # not a dead tensor's id

    def track(self, value: torch.Tensor, node: torch.fx.Node) -> None:
        self.nodes[id(value)] = (weakref.ref(value), node)
        node.meta["val"] = meta_value(value)

    def check(self, a: Any) -> torch.Tensor | None:
        """The first tensor in `a` (None if none); raises Unrecordable for what make_fx
        must trace: a tensor neither the trace's nor a plain real tensor or Parameter (a
        constant) but a subclass, a symbolic size."""
        first = None
        for x in _leaves(a):
            if isinstance(x, torch.Tensor):
                if type(x) not in (torch.Tensor, torch.nn.Parameter) and self.node_of(x) is None:
                    raise Unrecordable(f"a {type(x).__name__} the trace did not make")
                first = x if first is None else first
            elif type(x) not in _LITERALS:  # a symbolic size, a generator (make_fx's opaque object)...
                raise Unrecordable(f"an argument of type {type(x).__name__}")
        return first

    def argument(self, a: Any) -> Any:
        """`a` with each tensor replaced by its node; a real tensor (a constant the graph
        holds) by a get_attr node of it, named as make_fx names it."""
        if isinstance(a, torch.Tensor):
            node = self.node_of(a)
            return node if node is not None else self.constant(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.argument(x) for x in a)
        if isinstance(a, dict):
            return {k: self.argument(v) for k, v in a.items()}
        return a

    def constant(self, t: torch.Tensor) -> torch.fx.Node:
        qualname = self.constants.get(id(t))
        if qualname is None:
            prefix = "_param_constant" if isinstance(t, torch.nn.Parameter) else "_tensor_constant"
            qualname = next(f"{prefix}{i}" for i in itertools.count() if not hasattr(self.root, f"{prefix}{i}"))
            setattr(self.root, qualname, t)  # also keeps `t` alive, so its id stays its own
            self.constants[id(t)] = qualname
        node = self.appender.create_node("get_attr", qualname, (), {})
        node.meta["val"] = meta_value(t)
        return node

    def outputs(self, out: Any, node: torch.fx.Node) -> None:
        """Track an op's outputs as make_fx does: a tensor is the node's value; a list or
        tuple gets a getitem node per element, whatever the element."""
        if isinstance(out, torch.Tensor):
            self.track(out, node)
        elif isinstance(out, (list, tuple)):
            node.meta["val"] = meta_value(out)
            for i, item in enumerate(out):
                item_node = self.appender.create_node("call_function", operator.getitem, (node, i), {}, name="getitem")
                self.outputs(item, item_node)
        elif out is not None and type(out) not in (bool, int, float, complex):  # a symbolic size, an opaque object
            raise Unrecordable(f"an output of type {type(out).__name__}")

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # asked of fake tensors hundreds of times a trace
            device = fake_device(args[0]) if len(args) == 1 and not kwargs else None
            return device if device is not None else func(*args, **kwargs)
        name = _node_name(func, self.graph)
        if name is None:
            raise Unrecordable(str(func))
        if func is aten.lift_fresh.default:  # as make_fx: the graph copies its constant
            func = aten.lift_fresh_copy.default
            name = "lift_fresh_copy"
        with original_aten_op(func):  # as make_fx: around everything the op records
            if self.report is None or self.depth:
                return self.record(func, args, kwargs, name)
            args, kwargs = _as_passed_on(func, args, kwargs)
            self.depth += 1
            try:
                out = self.record(func, args, kwargs, name)
            finally:
                self.depth -= 1
        tensors = [x for x in _leaves(out) if isinstance(x, torch.Tensor)]
        self.report([self.node_of(x) for x in tensors], tensors)
        return out

    def record(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], name: str) -> Any:
        first = self.check((args, kwargs))
        key = (id(func), None if first is None else first.device.type)  # ops live as long as `_OPS`
        decomposes = self.decomposes.get(key)
        if decomposes is None:
            decomposes = self.decomposes[key] = autograd_would_decompose(func, [] if first is None else [first])
        if decomposes:  # as make_fx: the decomposition autograd would have run, recorded
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        node_args, node_kwargs = self.argument(args), self.argument(kwargs)
        node = self.appender.create_node("call_function", func, node_args, node_kwargs, name=name)
        out = func(*args, **kwargs)
        self.outputs(out, node)
        return out


# id of an op -> (the op, the name of its nodes, or None for an op left to make_fx).
# Keyed by id (an op's own hash is a Python call), the op kept to check it.
_OPS: dict[int, tuple[Any, str | None]] = {}


def _node_name(func: Any, graph: torch.fx.Graph) -> str | None:
    """The base name of `func`'s nodes, as make_fx names them; None if make_fx must trace it."""
    entry = _OPS.get(id(func))
    if entry is None or entry[0] is not func:
        left = (
            func in _LEFT_TO_MAKE_FX or not _LEFT_TO_MAKE_FX_TAGS.isdisjoint(func.tags)
            or func.namespace not in _RECORDED_NAMESPACES
        )
        entry = _OPS[id(func)] = (func, None if left else graph._target_to_str(func.overloadpacket.__name__))
    return entry[1]


def _is_default(value: Any, default: Any) -> bool:
    return default is not NO_DEFAULT and type(value) is type(default) and bool(value == default)


def _as_passed_on(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Sequence[Any], dict[str, Any]]:
    """The arguments as a dispatch mode above this one would pass them on (its call from
    Python leaves out trailing positional and keyword-only arguments equal to their
    defaults). An op called from C++ can arrive with them: an absent optional tensor is an
    undefined tensor there, which torch does not count as its default None
    (`_embedding_bag`'s `per_sample_weights` from `embedding_bag`)."""
    positional, keyword = schema_defaults(func)
    n = len(args)
    while n and n <= len(positional) and _is_default(args[n - 1], positional[n - 1]):
        n -= 1
    if n < len(args):
        args = args[:n]
    if any(k in keyword and _is_default(v, keyword[k]) for k, v in kwargs.items()):
        kwargs = {k: v for k, v in kwargs.items() if not (k in keyword and _is_default(v, keyword[k]))}
    return args, kwargs


def _leaves(a: Any) -> list[Any]:
    """The items of `a`, lists, tuples and dicts flattened, in order."""
    leaves: list[Any] = []
    _gather(a, leaves)
    return leaves


def _gather(a: Any, leaves: list[Any]) -> None:
    if isinstance(a, (list, tuple)):
        for x in a:
            if isinstance(x, (list, tuple, dict)):
                _gather(x, leaves)
            else:
                leaves.append(x)
    elif isinstance(a, dict):
        _gather(list(a.values()), leaves)
    else:
        leaves.append(a)


def record_graph(fn: Callable[..., Any], examples: Sequence[torch.Tensor], fake_mode: Any) -> torch.fx.GraphModule:
    """The graph of `fn(*examples)` (fake tensors of `fake_mode`, concrete sizes), as
    make_fx would trace it; inside, `traced_node` gives the node of a tensor the trace
    made. Raises Unrecordable where make_fx must trace it."""
    if dispatch_modes_active():  # an outer trace's modes would see the ops; make_fx replaces them
        raise Unrecordable("a dispatch mode is active")
    graph, root = torch.fx.Graph(), torch.nn.Module()
    recorder = _OpRecorder(graph, root)
    for i, example in enumerate(examples):
        if type(example) is not FakeTensor or any(isinstance(s, torch.SymInt) for s in example.shape):
            raise Unrecordable("an input that is not a fake tensor of concrete sizes")
        recorder.track(example, graph.placeholder(f"arg{i}_1"))
    with fake_mode, make_fx_like_settings():
        with recorder:
            result = fn(*examples)
        recorder.check(result)
        graph.output(recorder.argument(result))  # a constant's value made by the trace's fake mode
    return graph_module(root, graph)


def active_recorder() -> _OpRecorder | None:
    """The recorder making a trace on this thread (the autograd engine's threads inherit
    their caller's dispatch modes), if any."""
    for mode in reversed(active_dispatch_modes()):
        if isinstance(mode, _OpRecorder):
            return mode
    return None


def traced_node(t: torch.Tensor) -> torch.fx.Node | None:
    """The node the trace being made (the recorder's on this thread, or make_fx's) made
    for `t`; None when not tracing or not made by the trace."""
    recorder = active_recorder()
    return recorder.node_of(unwrap_transforms(t)) if recorder is not None else tracing_node(t)
