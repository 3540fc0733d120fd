"""Every private torch API remat relies on, each behind one small function.

Checked on torch 2.13.0. If a torch upgrade breaks remat, this file is where to look.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import operator
from typing import Any, Callable, Iterator, Sequence

import torch

# torch's private classes remat checks values against (torch 2.13)
from torch._ops import OpOverload as OpOverload
from torch._subclasses.fake_tensor import DataDependentOutputException as DataDependentOutputException
from torch._subclasses.fake_tensor import DynamicOutputShapeException as DynamicOutputShapeException
from torch._subclasses.fake_tensor import FakeTensor as FakeTensor
from torch._subclasses.fake_tensor import UnsupportedFakeTensorException as UnsupportedFakeTensorException
from torch._subclasses.fake_tensor import UnsupportedOperatorException as UnsupportedOperatorException

from .call_labels import NOT_RUN, CallLabels, counted, sac_ignored_ops, unchecked, waits


def torch_at_least(version: str) -> bool:
    """Whether the running torch is `version` or newer (the suite's floor is 2.13; the GPU
    machine's image has 2.11, where some of remat's paths are not available)."""
    return bool(torch.torch_version.TorchVersion(torch.__version__) >= version)


def replays_supported() -> bool:
    """Whether torch's selective checkpointing gives a policy the op's output (torch 2.13 does,
    2.11 asks before the op runs), which a replayed region's op-by-op decisions read."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    return "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def symbolic_templates_work() -> bool:
    """Whether a symbolic trace keeps its sizes symbolic under remat's dispatch modes: on
    torch 2.11 a dispatch mode above fake tensors is asked `aten.size.default` by C++
    kernels and the fake mode answers with ints, fixing every size (checked on 2.11.0 and
    2.13.0)."""
    return torch_at_least("2.13")


def clear_transforms() -> contextlib.AbstractContextManager[Any]:
    """Hide active torch.func transforms, so tracing sees plain tensors (torch 2.13)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def transforms_active() -> bool:
    """True inside torch.func.grad/vmap/jvp/... (torch 2.13)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def nested_gradients() -> bool:
    """Whether two or more torch.func gradient transforms are active (grad of grad, jacrev
    of jacrev, hessian's reverse parts), so a backward will itself be differentiated (torch 2.13)."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return sum(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters()) >= 2


def autograd_engine_running() -> bool:
    """True while the autograd engine runs a backward node on this thread (torch 2.13)."""
    return torch._C._current_autograd_node() is not None


def grad_disabled_by_code() -> bool:
    """True when grad is off because code chose so (`no_grad`, `set_grad_enabled(False)`,
    `inference_mode`), not because an autograd.Function runs its forward (a custom op's
    autograd, which turns off forward-mode grad too; torch 2.13 and 2.11)."""
    if torch.is_grad_enabled():
        return False
    return bool(torch._C._is_fwd_grad_enabled()) or torch.is_inference_mode_enabled()


def forward_ad_active() -> bool:
    """True when forward-mode AD (torch.func.jvp or forward_ad.dual_level) is live (torch 2.13)."""
    return torch.autograd.forward_ad._current_level >= 0


# --- custom autograd.Functions (torch 2.13: autograd/function.py, _functorch/autograd_function.py)

_FUNCTION_HANDLER: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "remat_function_handler", default=None
)
# Function.apply hands over to autograd through `super().apply`, which finds the base below
# it: a Python class without an `apply` of its own, so one set there for a while is found
# first, however the Function's apply was reached (`fn = MyFunction.apply`, bound at import,
# holds the unpatched Function.apply), and after Function.apply has bound default arguments.
_APPLY_BASE = torch.autograd.function._SingleLevelFunction
assert "apply" not in vars(_APPLY_BASE), "torch 2.13: Function.apply's super().apply is _FunctionBase's"
_PATCHES = 0  # contexts that hold the patched apply (one trace at a time, under the trace lock)


def _apply_through_handler(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    def apply(*args: Any, **kwargs: Any) -> Any:
        return super(_APPLY_BASE, cls).apply(*args, **kwargs)  # type: ignore[misc]

    handler = _FUNCTION_HANDLER.get()
    if handler is None or is_custom_op_autograd(cls) or cls.__module__.startswith(("torch.", "remat.")):
        return apply(*args, **kwargs)
    token = _FUNCTION_HANDLER.set(None)  # a Function its forward applies is part of it
    try:
        return handler(cls, apply, args, kwargs)
    finally:
        _FUNCTION_HANDLER.reset(token)


@contextlib.contextmanager
def function_applications_to(handler: Callable[..., Any]) -> Iterator[None]:
    """While inside, in this context: `SomeFunction.apply(*args, **kwargs)` of a user's
    custom autograd.Function calls `handler(SomeFunction, apply, args, kwargs)`, where
    `apply` applies it as usual (torch's own Functions and custom ops' apply as usual).
    Reached from Function.apply outside torch.func transforms (traces run outside them),
    through an apply method bound before this context too; other threads and contexts see
    the usual apply."""
    global _PATCHES
    if _PATCHES == 0:
        _APPLY_BASE.apply = classmethod(_apply_through_handler)  # type: ignore[attr-defined]
    _PATCHES += 1
    token = _FUNCTION_HANDLER.set(handler)
    try:
        yield
    finally:
        _FUNCTION_HANDLER.reset(token)
        _PATCHES -= 1
        if _PATCHES == 0:
            del _APPLY_BASE.apply  # type: ignore[attr-defined]


def function_has_setup_context(function: type[torch.autograd.Function]) -> bool:
    """Whether the Function defines `setup_context` (torch.func transforms require it)."""
    from torch.autograd.function import _is_setup_context_defined

    return bool(_is_setup_context_defined(function.setup_context))


def function_has_vmap_rule(function: type[torch.autograd.Function]) -> bool:
    """Whether vmap can run the Function: a generated rule or its own `vmap`."""
    from torch._functorch.autograd_function import has_overridden_vmap_rule

    return bool(function.generate_vmap_rule or has_overridden_vmap_rule(function))


def is_custom_op_autograd(function: type) -> bool:
    """Whether an autograd.Function is the one torch.library.custom_op generates for an op
    with register_autograd: its forward is the op itself, which traces as one node whose
    derivative torch knows (torch 2.13, torch/_library/autograd.py)."""
    return function.__module__ == "torch._library.autograd" and function.__name__.startswith("GeneratedBackwardFor_")


def is_transform_wrapped(t: torch.Tensor) -> bool:
    """Whether `t` is a torch.func wrapper (grad's or vmap's) around another tensor (torch 2.13)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._C._functorch.is_batchedtensor(t)


def transform_levels(t: torch.Tensor) -> list[torch.Tensor]:
    """`t`, then each tensor under its torch.func wrappers, down to the plain tensor (torch 2.13)."""
    levels = [t]
    while is_transform_wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
        levels.append(t)
    return levels


def has_batched_level(t: torch.Tensor) -> bool:
    """Whether vmap batches `t` at some level (torch 2.13)."""
    return any(torch._C._functorch.is_batchedtensor(level) for level in transform_levels(t))


def innermost_vmap() -> tuple[int, str] | None:
    """(level, randomness) of the innermost torch.func transform when it is a vmap (torch
    2.13 and 2.11)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return None
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != TransformType.Vmap:
        return None
    return interpreter.level(), interpreter.randomness()


def any_vmap_active() -> bool:
    """Whether a vmap is among the active torch.func transforms (torch 2.13)."""
    return bool(active_vmaps())


def active_vmaps() -> list[tuple[int, str]]:
    """(level, randomness) of every active vmap, outermost first (torch 2.13 and 2.11).
    The one scan of the functorch stack; the questions above are read from it."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return []
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return [
        (i.level(), i.randomness())  # type: ignore[attr-defined]  # a VmapInterpreter's
        for i in retrieve_all_functorch_interpreters()
        if i.key() == TransformType.Vmap
    ]


def untracked_by_a_gradient_transform(t: torch.Tensor) -> bool:
    """Whether an active gradient transform (grad, vjp, jvp, jacrev, jacfwd) does not track
    `t` (wraps it at no level of its own): eager code refuses to write into such a tensor
    under that transform (torch 2.13: functorch's check for mutations of captured tensors)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    functorch = torch._C._functorch
    wrapped = {functorch.maybe_get_level(w) for w in transform_levels(t)[:-1]}
    gradients = (TransformType.Grad, TransformType.Jvp)
    return any(i.key() in gradients and i.level() not in wrapped for i in retrieve_all_functorch_interpreters())


def batched_within(t: torch.Tensor, level: int) -> bool:
    """Whether vmap batches `t` at `level`, under any other torch.func wrappers (grad's) (torch 2.13)."""
    functorch = torch._C._functorch
    return any(functorch.is_batchedtensor(w) and functorch.maybe_get_level(w) == level for w in transform_levels(t))


def batched_at(t: torch.Tensor, level: int) -> bool:
    """Whether vmap batches `t` at `level` (torch 2.13 and 2.11)."""
    functorch = torch._C._functorch
    return bool(functorch.is_batchedtensor(t)) and functorch.maybe_get_level(t) == level


def unwrap_transforms(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every torch.func wrapper (torch 2.13)."""
    return transform_levels(t)[-1]


def tracing_node(t: torch.Tensor) -> torch.fx.Node | None:
    """The FX node make_fx recorded for `t`, or None when not tracing (torch 2.13). Also
    under AOTAutograd (torch.compile), whose tensors are FunctionalTensors around the
    traced ones."""
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, get_proxy_slot

    mode = get_innermost_proxy_mode()
    if mode is None:
        return None
    base = unwrap_transforms(t)
    if isinstance(base, FunctionalTensor):
        base = torch._from_functional_tensor(base.elem)
    slot = get_proxy_slot(base, mode.tracer, default=None)
    if slot is None:
        return None
    return slot.proxy.node


def copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.copy_(value)` for a tensor that lives below the active torch.func transforms
    (batch norm's running statistics, captured by a function under `grad`): the value is
    taken off the grad levels above the target's and written with those transforms hidden,
    as batch norm's own kernel does. A value batched by vmap is written as is, so vmap
    refuses it as it refuses plain code (torch 2.13)."""
    functorch = torch._C._functorch
    target_level = functorch.maybe_get_level(target)
    while functorch.is_functorch_wrapped_tensor(value) and functorch.maybe_get_level(value) > target_level:
        if functorch.is_batchedtensor(value):
            target.copy_(value)
            return
        value = functorch.get_unwrapped(value)
    with clear_transforms():
        target.copy_(value)


def preserve_node_meta() -> contextlib.AbstractContextManager[None]:
    """Let a retrace copy node.meta['custom'] from the node being interpreted (torch 2.13)."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.preserve_node_meta()


def new_fake_mode() -> Any:
    """A FakeTensorMode that accepts real constants captured by the traced function; inside
    `symbolic_tracing`, that trace's one mode (torch 2.13)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    symbolic = _SYMBOLIC.get()
    if symbolic is not None:
        return symbolic[0]
    return FakeTensorMode(allow_non_fake_inputs=True)


def torch_function_state_now() -> Any:
    """How torch handles `__torch_function__` now: enabled, subclasses' disabled (inside a
    subclass's own `__torch_function__`, and so in the whole backward `t.backward()` runs
    for a subclass tensor `t`), or all disabled (torch 2.13 and 2.11, torch._C)."""
    return torch._C._get_torch_function_state()  # type: ignore[attr-defined]


@contextlib.contextmanager
def torch_function_state(state: Any) -> Iterator[None]:
    """Run with `__torch_function__` handled as `state` (from `torch_function_state_now`)
    says, then as before (torch 2.13 and 2.11, torch._C `_set_torch_function_state`)."""
    before = torch._C._get_torch_function_state()  # type: ignore[attr-defined]
    torch._C._set_torch_function_state(state)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch._C._set_torch_function_state(before)  # type: ignore[attr-defined]


# While a template is traced with symbolic sizes: its fake mode (with a shape environment)
# and, per id of a real input tensor, the dimensions traced as symbols.
_SYMBOLIC: contextvars.ContextVar[tuple[Any, dict[int, frozenset[int]]] | None] = contextvars.ContextVar(
    "remat_symbolic", default=None
)


@contextlib.contextmanager
def symbolic_tracing(dims: dict[int, frozenset[int]]) -> Iterator[Any]:
    """Every fake tensor mode asked for inside is one mode with a shape environment, so
    the dimensions `dims` names (per id of a real tensor) are traced as symbols, each at
    least 2 (torch specializes 0 and 1), and what the trace assumes of them is recorded
    as guards (torch 2.13, fx.experimental.symbolic_shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(duck_shape=False))
    mode.cache_enabled = False  # its entries hold symbolic sizes, slower to rebuild than to compute
    token = _SYMBOLIC.set((mode, dims))
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)  # it logs each meta function symbolic sizes defeat
    try:
        yield mode
    finally:
        fake_tensor_log.setLevel(level)
        _SYMBOLIC.reset(token)


def symbolic_stand_in(t: torch.Tensor) -> torch.Tensor | None:
    """Inside `symbolic_tracing`, a fake of real tensor `t` whose marked dimensions are
    symbols (its strides and storage offset follow from them); None elsewhere."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    symbolic = _SYMBOLIC.get()
    if symbolic is None or isinstance(t, FakeTensor):
        return None
    mode, dims = symbolic
    marked = dims.get(id(t), frozenset())
    sizes = [DimDynamic.DYNAMIC if d in marked else DimDynamic.STATIC for d in range(t.dim())]
    return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))  # type: ignore[no-any-return]


def guards_expression(mode: Any, placeholders: list[Any]) -> str | None:
    """What a symbolic trace assumed, as one Python expression over the sizes, strides and
    storage offsets of the graph's inputs, static ones included (torch 2.13)."""
    return mode.shape_env.produce_guards_expression(placeholders, ignore_static=False)  # type: ignore[no-any-return]


def guards_hold(mode: Any, expression: str | None, inputs: list[torch.Tensor]) -> bool:
    """Whether `inputs` (real tensors, in the graph's input order) satisfy `guards_expression`'s result."""
    return expression is None or bool(mode.shape_env.evaluate_guards_expression(expression, inputs))


def symbolic_expression(mode: Any, value: Any) -> Any:
    """The sympy expression of a SymInt/SymFloat/SymBool in its simplest known form
    (symbols the trace proved equal replaced by one), or None for a plain value."""
    if isinstance(value, SYMBOLIC_SCALARS):
        return mode.shape_env.replace(value.node.expr)
    return None


SYMBOLIC_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool)  # what a symbolic trace computes sizes as


def storage_extent(shape: tuple[Any, ...], stride: tuple[Any, ...]) -> Any:
    """Elements a tensor of this shape and strides spans from its storage offset on."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0


def fake_of_layout(
    mode: Any, shape: tuple[Any, ...], stride: tuple[Any, ...], offset: Any, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A fake tensor of this shape, strides and storage offset. A concrete layout is made by
    wrapping a meta tensor instead of dispatching through the fake mode (about 20x cheaper;
    torch 2.13, FakeTensor.__new__); a symbolic one goes through the mode."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not all(type(v) is int for v in (*shape, *stride, offset)):
        with mode:
            if offset == 0:
                return torch.empty_strided(shape, stride, dtype=dtype, device=device)
            base = torch.empty(offset + storage_extent(shape, stride), dtype=dtype, device=device)
            return base.as_strided(shape, stride, offset)
    if offset == 0:
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    else:
        meta = torch.empty(offset + storage_extent(shape, stride), dtype=dtype, device="meta").as_strided(shape, stride, offset)
    return FakeTensor(mode, meta, device)


# Whether autocast is on for any device: asked by every graph run, so the C++ check itself,
# without a Python frame around it (torch 2.13).
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled


@contextlib.contextmanager
def autocast_cache_off() -> Iterator[None]:
    """Autocast's cast cache off, as make_fx traces: a context the traced function opens
    with `cache_enabled=True` would otherwise cache casts inside the trace."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


def autocast_nesting() -> int:
    """How many autocast contexts (enabled or not) are open: autocast's cast cache lives
    while one is (torch 2.13 counts them; there is no getter, so one up and one down)."""
    nesting = int(torch.autocast_increment_nesting()) - 1
    torch.autocast_decrement_nesting()
    return nesting


def autocast_state() -> tuple[Any, ...]:
    """Everything autocast that changes what a traced graph computes (one constant when no
    device's autocast is on, the common case, asked on every call: torch 2.13)."""
    if not torch._C._is_any_autocast_enabled():
        return _NO_AUTOCAST
    state: list[Any] = []
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        state.append((device, enabled, torch.get_autocast_dtype(device) if enabled else None))
    state.append(torch.is_autocast_cache_enabled())
    return tuple(state)


_NO_AUTOCAST = ("no autocast",)


# Global switches that decide which aten ops a composite traces to (torch 2.13 and 2.11,
# torch/backends): scaled_dot_product_attention picks its fused kernel (flash, memory-
# efficient, cuDNN, math, in this priority order), batch_norm its implementation and einsum
# its contraction order when it is called. A plan traced under one choice replayed under
# another would run other kernels, with other dropout draws, than eager code: the choice is
# part of what a plan depends on.
_KERNEL_SWITCHES = tuple(
    getattr(torch._C, name)
    for name in (
        "_get_flash_sdp_enabled",
        "_get_mem_efficient_sdp_enabled",
        "_get_math_sdp_enabled",
        "_get_cudnn_sdp_enabled",
        "_get_fa3_sdp_enabled",
        "_get_overrideable_sdp_enabled",
        "_get_math_sdp_allow_fp16_bf16_reduction",
        "_get_cudnn_enabled",
        "_get_mkldnn_enabled",
        "_get_deterministic_algorithms",
    )
    if hasattr(torch._C, name)
)
_priority_order = getattr(torch._C, "_get_sdp_priority_order", lambda: ())
# einsum's contraction order, chosen when it is called from `torch.backends.opt_einsum`'s
# `enabled` and `strategy`. That module is a PropModule whose class declares neither (torch
# 2.13 and 2.11): what code sets lands in the module object's own dict, what it does not set
# is read through __getattr__ from the original module's globals (2 µs); read here from both
# dicts directly, as einsum's attribute lookup finds them.
_OPT_EINSUM_SET = torch.backends.opt_einsum.__dict__
_OPT_EINSUM_DEFAULT = torch.backends.opt_einsum._get_enabled.__globals__
_MHA = torch.backends.mha  # nn.MultiheadAttention's fused inference path, chosen in its Python


def factory_defaults() -> tuple[Any, ...]:
    """The dtype and device factories such as `torch.ones(3)` use when not told (torch 2.13
    and 2.11: `set_default_dtype`, `set_default_device`, `with torch.device(...)`), which a
    trace writes into its graph. The device is read only while a torch-function mode is on
    (a device context is one): reading it costs microseconds, the check nanoseconds."""
    if not torch._C._is_torch_function_mode_enabled():
        return (torch.get_default_dtype(),)
    return (torch.get_default_dtype(), str(torch.get_default_device()))


def kernel_choices() -> tuple[Any, ...]:
    """The switches that choose which ops composites trace to (see above), as a key part."""
    return (
        *map(operator.call, _KERNEL_SWITCHES),  # in C: a generator here costs as much as the switches
        tuple(_priority_order()),
        _OPT_EINSUM_SET.get("enabled", _OPT_EINSUM_DEFAULT["enabled"]),
        _OPT_EINSUM_SET.get("strategy", _OPT_EINSUM_DEFAULT["strategy"]),
        _MHA._is_fastpath_enabled,
    )


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Within: no device autocasts. A region's stage-1 graph already holds the casts
    autocast made (and not those it did not: inside a composite such as SDPA's math path
    autocast is off), so replaying it, differentiating it and running its graphs must not
    cast again (torch 2.13)."""
    if not torch._C._is_any_autocast_enabled():
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def saved_tensor_hooks_suspended() -> Iterator[None]:
    """Lift the user's saved-tensor hooks while tracing: torch.func refuses to run under them,
    and a trace on fake tensors saves nothing worth hooking (torch 2.13)."""
    hooks = torch._C._autograd
    stack = []
    while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


# Keys remat's traces added to torch's fake-tensor dispatch cache, oldest first.
_FAKE_CACHE_KEYS: collections.deque[Any] = collections.deque()
FAKE_CACHE_ENTRIES = 4096  # at most this many of them stay (a few hundred per traced layer)
_FAKE_CACHE_DEPTH = [0]  # nesting of fake_tensor_cache_bounded (traces run under TRACE_LOCK): the outermost accounts


@contextlib.contextmanager
def fake_tensor_cache_bounded() -> Iterator[None]:
    """Fake tensor modes made inside use torch's process-wide dispatch cache (a traced
    layer repeats ops: tens of ms of a Llama layer's trace), but nothing bounds that
    cache, so afterwards remat drops its oldest entries beyond FAKE_CACHE_ENTRIES. Entries
    are appended in order and never removed by torch, so the new ones are the tail
    (torch 2.13, FakeTensorMode.cache)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = FakeTensorMode.cache
    before = len(cache)
    _FAKE_CACHE_DEPTH[0] += 1
    try:
        yield
    finally:
        _FAKE_CACHE_DEPTH[0] -= 1
        if _FAKE_CACHE_DEPTH[0] == 0:
            if len(cache) > before:
                _FAKE_CACHE_KEYS.extend(itertools.islice(cache, before, None))
            _drop_oldest_fake_cache_entries(keep=FAKE_CACHE_ENTRIES)


def _drop_oldest_fake_cache_entries(keep: int) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    while len(_FAKE_CACHE_KEYS) > keep:
        FakeTensorMode.cache.pop(_FAKE_CACHE_KEYS.popleft(), None)


def drop_fake_cache_entries() -> None:
    """Remove from torch's fake-tensor dispatch cache every entry remat's traces put there."""
    _drop_oldest_fake_cache_entries(keep=0)


def lazy_graph_modules() -> contextlib.AbstractContextManager[None]:
    """GraphModules that make_fx builds inside generate their Python code when first run or
    read, not when built (torch 2.13, fx._lazy_graph_module): most of remat's graphs are
    only analysed, and generating code for a layer's graph costs milliseconds."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """`torch.fx.GraphModule(root, graph)`, generating its code lazily (see lazy_graph_modules)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def trace_on_fakes(
    fn: Callable[..., Any], decomposition_table: dict[Any, Callable[..., Any]] | None = None
) -> Callable[..., torch.fx.GraphModule]:
    """make_fx on fake tensors, real constants allowed, without the torch-function mode that
    only records which torch function each node came from (a Python call per function
    traced; remat does not read it) (torch 2.13)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(
        fn, decomposition_table, tracing_mode="fake", _allow_non_fake_inputs=True, _disable_torch_fn_metadata_mode=True
    )


def dispatch_modes_active() -> bool:
    """Whether any torch dispatch mode (a user's, or an outer trace's proxy, fake or
    functional mode) is active (torch 2.13: the count includes those infra modes)."""
    return bool(torch._C._len_torch_dispatch_stack())


@contextlib.contextmanager
def make_fx_like_settings() -> Iterator[None]:
    """What make_fx sets around a trace on fake tensors (no proxy mode): autocast's cast
    cache off, so casts of parameters are ops seen by the trace, and fx's "is tracing"
    flag, which code may read (torch.compile'd functions then run uncompiled) (torch 2.13,
    fx.experimental.proxy_tensor and fx._symbolic_trace)."""
    import torch.fx._symbolic_trace as symbolic_trace
    from torch.fx.experimental.proxy_tensor import disable_autocast_cache

    was_tracing = symbolic_trace._is_fx_tracing_flag
    symbolic_trace._is_fx_tracing_flag = True
    try:
        with disable_autocast_cache():
            yield
    finally:
        symbolic_trace._is_fx_tracing_flag = was_tracing


def active_dispatch_modes() -> list[Any]:
    """The dispatch modes on this thread's stack, innermost last; the autograd engine's
    threads see their caller's (torch 2.13, utils._python_dispatch)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()  # type: ignore[no-any-return]


def original_aten_op(func: Any) -> contextlib.AbstractContextManager[Any]:
    """Nodes created inside carry `func` as meta "original_aten", as make_fx's do (torch 2.13)."""
    from torch.fx.experimental.proxy_tensor import set_original_aten_op

    return set_original_aten_op(func)  # type: ignore[no-any-return]


def fake_device(t: Any) -> torch.device | None:
    """What a fake tensor answers a device query (`prim.device`) with, as its fake mode
    would, for a plain FakeTensor; None for anything else (torch 2.13,
    _subclasses.fake_tensor FakeTensor.__torch_dispatch__)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(t) is not FakeTensor:
        return None
    return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device


def meta_value(value: Any) -> Any:
    """The meta "val" make_fx stores for a node's value: a fake tensor detached (without a
    trip through dispatch), a real constant as a fake of its layout from the active fake
    mode, a list or tuple element by element (torch 2.13, fx.experimental.proxy_tensor)."""
    from torch.fx.experimental.proxy_tensor import extract_val

    return extract_val(value)


def autograd_would_decompose(func: Any, flat_args: Sequence[Any]) -> bool:
    """Whether autograd would have run `func`'s CompositeImplicitAutograd decomposition for
    these arguments; make_fx runs it when such an op reaches its mode (torch 2.13,
    utils._python_dispatch)."""
    from torch.utils._python_dispatch import autograd_would_have_decomposed

    return bool(autograd_would_have_decomposed(func, flat_args))


@contextlib.contextmanager
def tracing_isolated() -> Iterator[None]:
    """Trace as if at top level: no active torch.func transforms, no dispatch mode of the
    caller's (a FlopCounterMode counts the region's ops when they run, not its trace's), no
    saved-tensor hooks, a bound on what it leaves in torch's fake-tensor cache; graphs
    built lazily."""
    with dispatch_modes_off(), clear_transforms(), saved_tensor_hooks_suspended(), fake_tensor_cache_bounded(), lazy_graph_modules():
        yield


def size_hint(size: Any) -> int:
    """A concrete int for a size that may be symbolic (under torch.compile's dynamic
    shapes), without adding a guard (torch 2.13, fx.experimental.symbolic_shapes)."""
    if isinstance(size, torch.SymInt):
        try:
            from torch.fx.experimental.symbolic_shapes import optimization_hint
        except ImportError:  # torch 2.11 (the GPU image's) calls it size_hint
            from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint  # type: ignore[attr-defined,no-redef]

        return int(optimization_hint(size))
    return int(size)


def dispatch_modes_off() -> contextlib.AbstractContextManager[Any]:
    """No torch dispatch mode (fake, proxy, functionalization) sees the ops run inside:
    for meta tensors made while a mode is tracing (torch 2.13, utils._python_dispatch)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()  # type: ignore[no-any-return]


def apply_function(function: type[torch.autograd.Function], first: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """`function.apply(first, *tensors)`, cheaper outside torch.func transforms: there
    Function.apply binds the arguments to `forward`'s signature (a no-op for a forward
    taking `*args`), unwraps dead torch.func wrappers and calls the C++ apply, which this
    does directly, the unwrapping with the C++ helper `unwrap_dead_wrappers` loops over
    (torch 2.13, autograd/function.py Function.apply, _functorch/utils.py)."""
    if _functorch_stack_nonempty():
        return function.apply(first, *tensors)
    return _cpp_apply(function, first, *map(_unwrap_if_dead, tensors))


def op_entry_point(namespace: str, name: str, overload: str) -> Callable[..., Any] | None:
    """The C++ entry point `torch.ops.<namespace>.<name>.<overload>(...)` forwards to, or
    None where that call does more (higher-order ops, torchbind ops): exactly
    `torch._ops.OpOverload.__call__` is `return self._op(*args, **kwargs)` (checked on
    torch 2.11 and 2.13, torch/_ops.py)."""
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None
    return op._op if type(op) is torch._ops.OpOverload else None  # type: ignore[no-any-return]


def entry_point_of(target: Any) -> Callable[..., Any] | None:
    """The C++ entry point calling `target` forwards to, for an op overload (see
    `op_entry_point`); None for any other target."""
    return target._op if type(target) is torch._ops.OpOverload else None  # type: ignore[no-any-return]


def plain_code_generation(graph: torch.fx.Graph) -> bool:
    """Whether fx's code for `graph` takes its placeholders as they are and returns its
    output as it is (no pytree flattening around it; torch 2.13: fx/graph.py `Graph._codegen`)."""
    return type(graph._codegen) is torch.fx.graph.CodeGen


def generated_code(gm: torch.fx.GraphModule) -> tuple[str, dict[str, Any]]:
    """fx's Python code for `gm` and the globals it runs with. A graph with plain code
    generation gets them from the graph, without compiling fx's own forward too (a lazy
    graph module that never ran would compile it only for it to be replaced: milliseconds
    per graph); any other from the module, as fx compiled it (torch 2.13: fx/graph.py
    `Graph._codegen`, `python_code`)."""
    if plain_code_generation(gm.graph):
        generated = gm.graph.python_code(root_module="self")
        return generated.src, dict(generated.globals)
    code = gm.code  # a lazy graph module generates its code (and forward) here
    return code, dict(type(gm).forward.__globals__)


_functorch_stack_nonempty = torch._C._are_functorch_transforms_active  # transforms_active's answer, from C++
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_cpp_apply = vars(torch._C._FunctionBase)["apply"]  # called with the Function class first


@torch._dynamo.assume_constant_result
def transforms_active_while_compiling() -> bool:
    """Whether a torch.func transform is active, asked while dynamo traces (dynamo cannot
    call the functorch builtin, so the answer is taken once, at trace time; torch 2.13)."""
    return transforms_active()


@torch._dynamo.assume_constant_result
def graph_breaks_are_errors() -> bool:
    """Whether the code dynamo traces now may not break its graph (`fullgraph=True`, or
    `error_on_graph_break`), asked once at trace time (torch 2.13: the translator's flags)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    translator = InstructionTranslator.current_tx()
    return bool(translator.one_graph or translator.error_on_graph_break)


# --- module hooks (torch 2.13 and 2.11: nn/modules/module.py, utils/hooks.py) -------------

GLOBAL_FORWARD_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks")


def global_forward_hook_table(name: str) -> dict[int, Any]:
    """One of the tables `register_module_forward_pre_hook` / `..._forward_hook` fill."""
    import torch.nn.modules.module as module

    return getattr(module, name)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def reparametrizing_hooks() -> tuple[type, ...]:
    """The classes of torch's forward pre-hooks that recompute a module's weight from its
    parameters and set it on the module before each forward: `torch.nn.utils.weight_norm`,
    `spectral_norm` (which also steps its power iteration in place) and `torch.nn.utils.prune`
    (torch 2.13 and 2.11; the modules share their names with functions of torch.nn.utils)."""
    import importlib

    return (
        importlib.import_module("torch.nn.utils.weight_norm").WeightNorm,
        importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm,
        importlib.import_module("torch.nn.utils.prune").BasePruningMethod,
    )


def hook_registrations() -> int:
    """torch's count of hook handles made so far (every module and tensor hook takes one):
    unchanged since a moment, no hook was registered since."""
    return int(torch.utils.hooks.RemovableHandle.next_id)


@contextlib.contextmanager
def calling_modules_through(wrapper: Callable[..., Any]) -> Iterator[None]:
    """Within: every `module(...)` runs `wrapper(Module._call_impl, module, *args, **kwargs)`,
    where `_call_impl` is what runs a module's hooks around its forward."""
    original = torch.nn.Module._call_impl

    def call_impl(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapper(original, self, *args, **kwargs)

    torch.nn.Module._call_impl = call_impl  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._call_impl = original  # type: ignore[method-assign]


@contextlib.contextmanager
def below_a_vmap_refusing_randomness(tensors: Sequence[Any]) -> Iterator[None]:
    """Within: when the innermost transform is a vmap with `randomness="error"` (jacrev's,
    jacfwd's) and none of `tensors` is batched by it, the ops run below it, as unbatched
    ops: a replayed draw there is no new draw, and eager code never makes it under that
    vmap (torch 2.13 and 2.11, _functorch/pyfunctorch.py)."""
    from torch._C._functorch import TransformType, is_batchedtensor, maybe_get_level
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter, temporarily_pop_interpreter_stack

    interpreter = retrieve_current_functorch_interpreter() if torch._C._functorch.peek_interpreter_stack() is not None else None
    if interpreter is None or interpreter.key() != TransformType.Vmap or interpreter.randomness() != "error":
        yield
        return
    level = interpreter.level()
    if any(isinstance(t, torch.Tensor) and is_batchedtensor(t) and maybe_get_level(t) == level for t in tensors):
        yield
        return
    with temporarily_pop_interpreter_stack():
        yield


def below_autograd(keyset: Any) -> Any:
    """The dispatch keys an op's Autograd kernel redispatches to, to run the op itself
    (torch 2.13, as torch.library's custom ops do)."""
    return keyset & torch._C._after_autograd_keyset


# --- selective checkpointing's cache (torch 2.13: utils/checkpoint.py) -----------------------


def selective_checkpoint_contexts(
    policy_fn: Callable[..., Any],
    transparent: Sequence[Any] = (),
    numbered: Callable[[Any, Any, Any], bool] = lambda *_: False,
) -> tuple[Any, Any]:
    """`create_selective_checkpoint_contexts(policy_fn)`, with three changes. A kept value
    serves every recompute, not only the first (torch's cached mode consumes each kept
    value, so a second backward through the region, a gradient of a gradient or
    `retain_graph=True`, raises "backward an extra time", where eager code and plain
    checkpoint run it). A cast autocast may take from its cache is neither counted nor kept
    (`autocast_may_cache`). And a kept value is handed out only to the recompute's call
    that was given what the forward's was (`CallLabels`); another call computes its output, and
    the cached mode's `diverged` says which (`transparent`: ops whose output is told as
    their input, as the recompute may not run them; `numbered`: calls told apart by their
    count, random draws). The kept values live as long as the region's
    backward graph, as its saved tensors would. (Before torch 2.13, torch's own contexts.)"""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    modes = _sac_mode_classes()
    if modes is None:
        return create_selective_checkpoint_contexts(policy_fn)
    caching, cached = modes
    storage: dict[Any, dict[int, Any]] = collections.defaultdict(dict)
    calls = CallLabels(frozenset(transparent) | sac_ignored_ops() | waits(), numbered)
    return caching(policy_fn, storage, calls), cached(storage, calls)


@functools.cache
def _sac_mode_classes() -> tuple[type, type] | None:
    """torch's caching and cached modes (their __torch_dispatch__ in torch 2.13) with what
    `selective_checkpoint_contexts` changes, or None where torch lacks them."""
    try:
        from torch.utils._pytree import tree_map
        from torch.utils.checkpoint import (
            _RECOMPUTE,
            _CachedTorchDispatchMode,
            _CachingTorchDispatchMode,
            _detach_helper,
            _sac_storage_key,
        )
    except ImportError:
        return None

    class Caching(_CachingTorchDispatchMode):  # type: ignore[misc, valid-type]
        def __init__(self, policy_fn: Callable[..., Any], storage: dict[Any, Any], calls: CallLabels) -> None:
            super().__init__(policy_fn, storage)
            self.calls = calls

        def __enter__(self) -> Any:
            self.calls.start()
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            leaves, given, out = self.calls.take(func, args, kwargs)
            if out is not NOT_RUN:
                return out
            out = super().__torch_dispatch__(func, types, args, kwargs)
            key = _sac_storage_key(func, args)
            index = self.func_counter[key] - 1
            self.calls.given[key, index] = given
            self.calls.record(func, args, kwargs, leaves, given, out, index)
            return out

    class RepeatableCache(_CachedTorchDispatchMode):  # type: ignore[misc, valid-type]
        """torch's cached mode without consuming entries, handing a kept value out only to
        the call given what the forward's was. Each hand-out is a fresh alias without autograd
        metadata: autograd gives the recompute's output its history (a view's, for a view op),
        and the kept tensor itself must stay without one for the next recompute."""

        def __init__(self, storage: dict[Any, Any], calls: CallLabels) -> None:
            super().__init__(None, storage)
            self.calls = calls
            self.diverged: str | None = None  # the first call given otherwise, described

        def __enter__(self) -> Any:
            self.calls.start()
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            leaves, given, out = self.calls.take(func, args, kwargs)
            if out is not NOT_RUN:
                return out
            key = _sac_storage_key(func, args)
            index = self.func_counter[key]  # reset when a recompute enters the mode
            self.func_counter[key] += 1
            entry = self.storage.get(key, {}).get(index)
            if entry is None:
                raise RuntimeError(
                    f"remat: the recompute of a replayed region calls {func} (call {index}), which its forward "
                    "did not: the region's Python ran differently in backward (global state changed since?)"
                )
            if entry is not _RECOMPUTE and self.calls.given.get((key, index)) != given and not unchecked(func):
                if self.diverged is None:
                    self.diverged = f"{func} (call {index})"
                entry = _RECOMPUTE
            if entry is _RECOMPUTE:
                out = func(*args, **kwargs)
            else:
                out = tree_map(lambda x: _detach_helper(x.get_val(self.allow_cache_entry_mutation)), entry)
            self.calls.record(func, args, kwargs, leaves, given, out, index)
            return out

    return Caching, RepeatableCache


class SacEntry:
    """The cache entry of one op call under the caching mode that
    `create_selective_checkpoint_contexts` returned first, found while the policy is
    asked about that call: the mode counts the call before it asks and stores the entry
    `storage[key][count - 1]` after (torch 2.13, _CachingTorchDispatchMode.__torch_dispatch__).
    Changed later, it makes the recompute recompute the output (`forget`) or take `value`
    (`keep`), as the policy's other answer would have."""

    __slots__ = ("storage", "key", "index")

    def __init__(self, caching: Any, op: Any, args: tuple[Any, ...]) -> None:
        from torch.utils.checkpoint import _sac_storage_key

        self.key = _sac_storage_key(op, args)
        self.index = caching.func_counter[self.key] - 1
        self.storage = caching.storage

    @classmethod
    def of_call(cls, caching: Any, op: Any, args: tuple[Any, ...]) -> SacEntry | None:
        """The entry of the op call the caching mode has just seen, or None for an op it
        neither counts nor caches (`counted`)."""
        return cls(caching, op, args) if counted(op, args) else None

    def kept(self) -> bool:
        """Whether the recompute takes this call's output from the cache."""
        from torch.utils.checkpoint import _RECOMPUTE

        return self.storage.get(self.key, {}).get(self.index, _RECOMPUTE) is not _RECOMPUTE

    def forget(self) -> None:
        from torch.utils.checkpoint import _RECOMPUTE

        self.storage[self.key][self.index] = _RECOMPUTE

    def keep(self, value: torch.Tensor) -> None:
        from torch.utils.checkpoint import _detach_helper, _VersionWrapper

        self.storage[self.key][self.index] = _VersionWrapper(_detach_helper(value))


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s memory: itself, or a wrapper subclass's inner
    tensors (a DTensor's local shard), read through the subclass protocol
    (`__tensor_flatten__`, torch 2.13), which runs no op: a dispatch mode must not."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names if isinstance(part := getattr(t, name), torch.Tensor) for inner in inner_tensors(part)]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The one plain tensor behind a wrapper of one (this rank's shard of a DTensor); any
    other tensor itself."""
    inner = inner_tensors(t)
    return inner[0] if len(inner) == 1 else t


def is_expanded_weight(t: Any) -> bool:
    """Whether `t` is an ExpandedWeight, the per-sample-gradient wrapper of
    `torch.nn.utils._per_sample_grad.call_for_per_sample_grads` (torch 2.13,
    nn/utils/_expanded_weights/expanded_weights_impl.py)."""
    return isinstance(t, _expanded_weight_class())


@functools.cache
def _expanded_weight_class() -> type:
    """Imported on first use (the module imports torch.func machinery), then looked up once."""
    from torch.nn.utils._expanded_weights.expanded_weights_impl import ExpandedWeight

    return ExpandedWeight


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


@contextlib.contextmanager
def selective_checkpoint_compile_notice_off() -> Iterator[None]:
    """Without the notice torch logs once when it compiles a checkpoint given a context_fn
    (torch 2.13, _higher_order_ops/wrap.py, logger of that module): said to a user of
    `remat(..., dynamic=True)`, who compiled nothing, it is noise."""
    log = logging.getLogger("torch._higher_order_ops.wrap")
    notice = _DropNotice()
    log.addFilter(notice)
    try:
        yield
    finally:
        log.removeFilter(notice)


class _HookTable(collections.OrderedDict):  # type: ignore[type-arg]
    """A tensor's table of `register_hook` hooks whose hooks run only with a gradient: torch
    calls the hooks of one output of a node with several outputs with None when backward
    reaches the node through the others, where eager code's separate nodes would not run."""

    def __setitem__(self, key: Any, hook: Any) -> None:
        super().__setitem__(key, functools.partial(_with_gradient_only, hook))


def _with_gradient_only(hook: Callable[[torch.Tensor], Any], grad: torch.Tensor | None) -> Any:
    return None if grad is None else hook(grad)


def note_hook_tables(node_class: type) -> None:
    """Let the autograd nodes of `node_class` (a custom Function's backward class) note the
    tables of `register_hook` hooks of their outputs, as `node.hook_tables` (output number to
    table), which outlive the outputs; the tables are `_HookTable`s. torch's `register_hook`
    makes a tensor's table when it has none and hands it to `t.grad_fn._register_hook_dict`,
    which a subclass of torch's node class may extend (torch 2.13, _tensor.py register_hook):
    nothing runs per call, only per tensor hooked."""
    register = node_class._register_hook_dict  # type: ignore[attr-defined]

    def _register_hook_dict(node: Any, tensor: torch.Tensor) -> None:
        table = _HookTable()
        table.update(tensor._backward_hooks or {})
        tensor._backward_hooks = table
        register(node, tensor)
        tables = getattr(node, "hook_tables", None)
        if tables is None:
            tables = node.hook_tables = {}
        tables[tensor.output_nr] = table

    node_class._register_hook_dict = _register_hook_dict  # type: ignore[attr-defined]


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Whether `t` carries hooks of `register_hook` (torch 2.13: its `_backward_hooks` table)."""
    return bool(t._backward_hooks)
