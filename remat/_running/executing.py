"""Executing: the autograd.Function that runs a partitioned forward and backward.

It composes with torch.func because it is a modern autograd.Function (forward and
setup_context apart, a generated vmap rule). Kept intermediates are outputs of the
Function, so second-order gradients flow through them. It has no jvp rule: under
forward-mode AD a region runs its function as it is (see Rematerialized.__call__).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .._core.errors import RematError
from .._core.locking import TRACE_LOCK
from .._core.logs import logger
from .._core.nodes import DIFFERENTIABLE_KEY, is_random
from .._core.torch_internals import (
    active_vmaps,
    any_autocast_enabled,
    apply_function,
    autocast_off,
    batched_at,
    batched_within,
    dispatch_modes_off,
    fake_tensor_cache_bounded,
    has_batched_level,
    has_tensor_hooks,
    innermost_vmap,
    note_hook_tables,
    transforms_active,
    untracked_by_a_gradient_transform,
    unwrap_transforms,
)
from .._partition.partitioning import Partition, partition
from .._trace.passes import without_absent_cotangents
from .._trace.records import InPlaceWrite, StageOne
from .._trace.tracing import vjp_of_graph
from .graph_code import direct_code
from .layouts import broadcast_tangents, run_checked

Strides = tuple[tuple[int, ...] | None, ...]  # per gradient, its strides, or None for a contiguous one (or none)
HigherOrderKey = tuple[frozenset[int], tuple[int, ...], Strides]  # outputs read, inputs held, layouts
HigherOrder = tuple[Partition, list[int], list[int]]  # the partition, where its inputs sit, its cotangent outputs


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


@dataclass
class Plan:
    """Everything remat needs to run one traced signature of one function."""

    stage_one: StageOne
    part: Partition
    diff_inputs: list[int]  # inputs that get gradients
    float_outputs: list[int]  # outputs that receive cotangents
    region: str
    # higher-order backwards, by which outputs they read as the caller's own tensors, the inputs
    # at hand and the gradients' layouts (see `higher_order`)
    _higher_orders: dict[HigherOrderKey, HigherOrder] = field(default_factory=dict, repr=False)
    # graphs (by id) whose layouts were checked on a first run, each with what runs it next
    _checked: dict[int, Callable[..., Any]] = field(default_factory=dict, repr=False)
    extra_inputs: list[int] = field(default_factory=list)  # inputs kept only for second-order gradients
    # backwards for calls where some outputs get no gradient, by (graph id, which cotangents are absent)
    _pruned: dict[tuple[int, frozenset[int]], torch.fx.GraphModule] = field(default_factory=dict, repr=False)
    # per backward graph (by id), the cotangents a broadcast gradient enters as it is (`cotangent`)
    _broadcast_as_is: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)
    # the partition of the same joint with its tangents traced with given strides (`laid_out_backward`)
    relayout: Callable[[Strides], Partition] | None = field(default=None, repr=False)
    # backwards for gradients laid out otherwise than contiguous, by their strides (None: none fits)
    _laid_out: dict[Strides, torch.fx.GraphModule | None] = field(default_factory=dict, repr=False)
    # the same for higher-order backwards, by `higher_order`'s key
    _higher_laid_out: dict[HigherOrderKey, HigherOrder | None] = field(default_factory=dict, repr=False)
    trace_seconds: float = 0.0  # what a plain trace of the function took (`_plans/templates` prices templates by it)
    builds_graph: bool = True  # its backward was traced as autograd runs one that builds a graph
    # per input in diff_inputs, how many gradients the backward gives it: one per use for an
    # input used more than once (`_trace/tracing.differentiate`); empty: one each
    gradient_counts: list[int] = field(default_factory=list)

    def run(self, gm: torch.fx.GraphModule, *inputs: Any) -> Any:
        """Run one of this plan's graphs; its first run checks layouts against the trace.
        A graph holds autocast's casts already: under autocast it runs with autocast off."""
        if any_autocast_enabled():
            with autocast_off():
                return self._run(gm, *inputs)
        return self._run(gm, *inputs)

    def _run(self, gm: torch.fx.GraphModule, *inputs: Any) -> Any:
        try:
            direct = self._checked.get(id(gm))
            if direct is not None:
                return direct(*inputs)  # what gm(...) runs, without nn.Module's call machinery
            outputs, checked = run_checked(gm, self.region, *inputs)
        except RuntimeError as error:
            if not transforms_active() or isinstance(error, RematError):
                raise
            raise RematError(
                f"remat({self.region}): under a torch.func transform, torch could not run an op of the graph "
                f"remat traced: {str(error).splitlines()[0]} remat runs a functional form of what eager code "
                "runs in place, and torch has no batching rule for some of those ops (e.g. as_strided_scatter). "
                "Call that op outside the remat'd function."
            ) from error
        if checked:
            self._checked[id(gm)] = functools.partial(_second_run, self._checked, gm)
        return outputs

    def for_capture(self, stage_one: StageOne, region: str) -> Plan:
        """This plan for another region whose stage-1 graph is the same (`_plans/sharing`): the
        partitioned graphs are shared, names and captured tensors are the other region's."""
        return dataclasses.replace(
            self, stage_one=stage_one, region=region, _higher_orders={}, _higher_laid_out={},
            extra_inputs=list(self.extra_inputs),
        )  # the set of graphs whose layouts were checked is shared: the same graphs, inputs laid out alike

    def apply(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the region: its outputs, the new values of mutated inputs, then kept values.
        Inputs no output depends on differentiably enter detached, so autograd does not
        reach back into them, as it does not in eager code."""
        if self.unreached_inputs:
            inputs = list(inputs)
            for i in self.unreached_inputs:
                inputs[i] = inputs[i].detach()
        if self.more_uses:  # the Function takes such an input once per use: autograd adds each use's gradient
            inputs = [*inputs, *(inputs[i] for i in self.more_uses)]
        return apply_function(RematFunction, self, inputs)  # type: ignore[no-any-return]

    @functools.cached_property
    def unreached_inputs(self) -> list[int]:
        """Inputs that need grad but get none from any output (the backward gives None)."""
        grads = next(n for n in self.part.backward.graph.nodes if n.op == "output").args[0]
        return [i for i, g in zip(self.gradient_positions, grads) if g is None]

    @functools.cached_property
    def more_uses(self) -> list[int]:
        """The inputs the Function takes again after all of them, once per use after the
        first, in order: autograd adds the gradients of one tensor that a node takes
        several times one by one, in the order of the node's inputs."""
        return [i for i, count in zip(self.diff_inputs, self.gradient_counts) for _ in range(count - 1)]

    @functools.cached_property
    def gradient_positions(self) -> list[int]:
        """For each gradient the backward gives, which of the Function's inputs it is for."""
        if not self.more_uses:
            return list(self.diff_inputs)
        positions: list[int] = []
        again = len(self.stage_one.input_values)
        for i, count in zip(self.diff_inputs, self.gradient_counts):
            positions += [i, *range(again, again + count - 1)]
            again += count - 1
        return positions

    def backward_for(
        self,
        gm: torch.fx.GraphModule,
        grads: Sequence[torch.Tensor | None],
        outputs: Sequence[int],
        like: Sequence[Any],
        as_given: bool = False,
    ) -> tuple[torch.fx.GraphModule, list[torch.Tensor | None]]:
        """The backward to run for these incoming gradients (of `outputs`, in order), and its
        cotangents: outputs that get no gradient contribute nothing, as in eager autograd
        (`passes.without_absent_cotangents`, built once per graph and pattern). Gradients
        laid out otherwise than the backward was traced for enter a backward traced for
        their layout where one fits (`laid_out_backward`), else as `cotangent` makes them;
        `as_given`: `gm` was traced for their layouts."""
        absent = [k for k, j in enumerate(outputs) if grads[j] is None]
        pruned = self._without(gm, absent, len(outputs)) if absent else gm
        if as_given:  # a backward traced for these gradients' layouts
            return pruned, [grads[j] for j in outputs]
        as_is = self._broadcast_as_is.get(id(pruned))
        if as_is is None:
            as_is = broadcast_tangents(pruned, len(outputs))
            self._broadcast_as_is[id(pruned)] = as_is
        cotangents = [
            None if k in absent else self.cotangent(grads, j, like, k in as_is) for k, j in enumerate(outputs)
        ]
        if self.relayout is not None and gm is self.part.backward:
            for cotangent, j in zip(cotangents, outputs, strict=True):
                if cotangent is not None and cotangent is not grads[j]:  # a copy: laid out otherwise
                    given = [grads[j] for j in outputs]
                    strides = _strides_of(given)
                    laid_out = None if strides is None else self.laid_out_backward(strides)
                    if laid_out is not None:
                        return self._without(laid_out, absent, len(outputs)) if absent else laid_out, given
                    break
        return pruned, cotangents

    def _without(self, gm: torch.fx.GraphModule, absent: list[int], n_cotangents: int) -> torch.fx.GraphModule:
        """`gm` without what the cotangents at positions `absent` feed (built once per pattern)."""
        if not absent:
            return gm
        key = (id(gm), frozenset(absent))
        pruned = self._pruned.get(key)
        if pruned is None:
            cotangents = [n for n in gm.graph.nodes if n.op == "placeholder"][-n_cotangents:]
            pruned = self._pruned[key] = without_absent_cotangents(gm, cotangents, [cotangents[k] for k in absent])
        return pruned

    def laid_out_backward(self, strides: Strides) -> torch.fx.GraphModule | None:
        """The first-order backward traced for gradients with these strides (None: contiguous),
        as eager's derivatives run on them, so that its sums and products add in eager's
        order; None where it would read other kept values than the forward kept (its
        partition chose otherwise), where tracing it fails (a derivative reading memory a
        broadcast gradient does not have), or for the ninth layout and after (built once each)."""
        relayout = self.relayout
        if relayout is None:
            return None

        def build() -> torch.fx.GraphModule | None:
            part = relayout(strides)
            same = (part.saved_inputs, part.residual_outputs, part.replayed, part.forward.code) == (
                self.part.saved_inputs, self.part.residual_outputs, self.part.replayed, self.part.forward.code
            )
            return part.backward if same else None

        return _built_once(self._laid_out, strides, build, self.region)  # type: ignore[no-any-return]

    def plans(self) -> list[Plan]:
        return [self]

    @functools.cached_property
    def n_outputs(self) -> int:
        return self.stage_one.n_outputs + len(self.stage_one.mutated)

    @functools.cached_property
    def _output_nodes(self) -> list[torch.fx.Node]:
        return list(next(n for n in self.part.forward.graph.nodes if n.op == "output").args[0])

    @functools.cached_property
    def output_values(self) -> list[Any]:
        return [node.meta["val"] for node in self._output_nodes]

    @functools.cached_property
    def nondifferentiable_outputs(self) -> list[int]:
        """Integer outputs, new values of mutated inputs, and kept values autograd does not
        track (integers, layer_norm's mean and rstd, dropout's mask)."""
        kept = range(self.n_outputs, len(self._output_nodes) - self.part.checked)  # debug values are not
        diff = set(self.float_outputs) | {
            j
            for j in kept
            if _is_float(self.output_values[j])
            and self._output_nodes[j].meta.get("custom", {}).get(DIFFERENTIABLE_KEY, True)
        }
        return [j for j in range(len(self._output_nodes)) if j not in diff]

    def cotangent(
        self, grads: Sequence[torch.Tensor | None], position: int, like: Sequence[Any], broadcast_as_is: bool = False
    ) -> torch.Tensor:
        """The incoming gradient of one output, as the traced backward expects it.

        Backward graphs were traced with contiguous tangents (their view ops assume it);
        autograd may hand over expanded or transposed gradients, and None for unused ones.
        A broadcast one (`.sum()`'s) enters as it is where the graph allows (`broadcast_as_is`,
        `layouts.broadcast_tangents`), as it does eager's backward: no copy of its size.
        """
        grad = grads[position]
        if grad is not None:
            if broadcast_as_is and not grad.is_contiguous() and not any(grad.stride()):
                return grad
            return grad.contiguous()
        val = self.output_values[position]
        device = next((t.device for t in like if isinstance(t, torch.Tensor)), val.device)
        return torch.zeros(tuple(val.shape), dtype=val.dtype, device=device)

    @functools.cached_property
    def _second_order(self) -> tuple[Partition, list[int], list[int]]:
        return self._second_order_reading(frozenset())

    def _second_order_reading(
        self, outputs: frozenset[int], as_eager: bool = True, strides: Strides = ()
    ) -> tuple[Partition, list[int], list[int]]:
        """The joint of the pure forward with cotangents for its kept values too, split
        keeping what the first-order forward keeps (`as_eager`: only what no recomputed
        value leads to, so that the second-order terms add as in eager), and the values of
        `outputs` (read as the caller's tensors, see `higher_order`); its cotangent outputs
        and the first-order residual positions. Cotangents traced with `strides` (see
        `laid_out_backward`)."""
        values = self.output_values
        cotangent_outputs = self.second_order_cotangents
        n_states = len(self.part.replayed) + self.part.checked
        n_values = len(values) - n_states  # rng states and debug values are not values of the pure graph
        inputs = self.stage_one.input_values
        joint = vjp_of_graph(
            self.part.forward_pure, inputs, self.diff_inputs, cotangent_outputs, self.gradient_counts, strides
        )
        outs = next(n for n in joint.graph.nodes if n.op == "output").args[0][:n_values]
        residuals = self.part.residual_outputs[: len(self.part.residual_outputs) - n_states]
        chosen = {outs[j] for j in [*residuals, *outputs]}
        full = partition(
            joint, len(inputs), n_values, chosen.__contains__, exact=True, second_order=as_eager,
            read_as_is=[outs[j] for j in outputs],
        )
        return full, cotangent_outputs, residuals

    def _unkept(
        self, full: Partition, residuals: list[int], reading: frozenset[int], held: tuple[int, ...]
    ) -> list[str]:
        """What the higher-order backward `full` reads that the first-order forward did not
        keep and is not `held`."""
        full_residuals = full.residual_outputs[: len(full.residual_outputs) - len(full.replayed)]
        kept_inputs = self.part.saved_inputs + self.extra_inputs + list(held)
        missing = [f"`{self.stage_one.input_paths[i]}`" for i in full.saved_inputs if i not in kept_inputs]
        inner = [f"`output {j}`" for j in full_residuals if j not in residuals and j not in reading]
        return missing + inner + [f"`random op {k}`" for k in full.replayed if k not in self.part.replayed]

    @functools.cached_property
    def unkept_inputs(self) -> list[int]:
        """Inputs first order does not keep, outside torch.func (which keeps what nesting
        needs): held weakly, so that a double backward can recompute from those still
        alive and unchanged (module parameters, the caller's tensors) instead of reading a
        kept value (see `_second_order_reading`)."""
        if self.builds_graph:
            return []
        kept = {*self.part.saved_inputs, *self.extra_inputs, *self.stage_one.mutated}
        return [i for i in range(len(self.stage_one.input_values)) if i not in kept]

    def keep_inputs_for_second_order(self) -> None:
        """Called when the plan is traced under nested gradients (torch.func.grad of grad,
        jacrev of jacrev): keep the inputs second order needs, even those first order does not."""
        full, _, _ = self._second_order
        self.extra_inputs = [i for i in full.saved_inputs if i not in self.part.saved_inputs]

    @functools.cached_property
    def every_input_differentiable(self) -> bool:
        """Whether the backward's gradients are those of every input, in order, one each."""
        return self.diff_inputs == list(range(len(self.stage_one.input_values))) and not self.more_uses

    @functools.cached_property
    def kept_pickers(self) -> tuple[Callable[[Sequence[Any]], tuple[Any, ...]], Callable[[Sequence[Any]], tuple[Any, ...]]]:
        """What the Function saves for backward, picked from its inputs and from its outputs."""
        return _picker(self.part.saved_inputs), _picker(self.part.residual_outputs)

    @functools.cached_property
    def n_first_order_kept(self) -> int:
        return len(self.part.saved_inputs) + len(self.part.residual_outputs)

    def higher_order(
        self, reading: frozenset[int] = frozenset(), held: tuple[int, ...] = (), strides: Strides = ()
    ) -> HigherOrder:
        """A backward that also takes cotangents for the kept values; where each of its kept
        inputs sits among the Function's saved tensors followed by the outputs in `reading`
        (in order) and the `held` inputs (in order); its cotangent outputs (built once per
        `reading`, `held` and `strides`, lazily).

        `reading`: outputs whose values the backward reads as the caller's own tensors, not
        recomputed, as eager autograd reads an op's saved output (see `outputs_to_read`).
        `held`: inputs first order did not keep that are still at hand (`held_inputs`).
        `strides`: the cotangents' layouts, where not contiguous (see `laid_out_higher_order`)."""
        with TRACE_LOCK, dispatch_modes_off():  # traces (make_fx keeps process-wide state): one at a time in the process
            built = self._higher_orders.get((reading, held, strides))
            if built is None:
                built = self._build_higher_order(reading, held, strides)
                self._higher_orders[(reading, held, strides)] = built
        return built

    def laid_out_higher_order(
        self, reading: frozenset[int], held: tuple[int, ...], grads: Sequence[torch.Tensor | None]
    ) -> HigherOrder | None:
        """`higher_order` traced for the layouts of `grads` where one is not contiguous, as
        first order does (`laid_out_backward`); None where all are, or where it cannot be
        traced (then `higher_order` for contiguous ones serves), or past the eighth layout."""
        strides = _strides_of([grads[j] for j in self.second_order_cotangents if j < len(grads)])
        if strides is None or all(s is None for s in strides):
            return None
        build = functools.partial(self.higher_order, reading, held, strides)
        return _built_once(self._higher_laid_out, (reading, held, strides), build, self.region)  # type: ignore[no-any-return]

    @functools.cached_property
    def second_order_cotangents(self) -> list[int]:
        """The outputs a higher-order backward takes cotangents for (see `_second_order_reading`)."""
        return [j for j in range(len(self.output_values)) if j not in self.nondifferentiable_outputs]

    def _build_higher_order(
        self, reading: frozenset[int], held: tuple[int, ...], strides: Strides = ()
    ) -> HigherOrder:
        if self.stage_one.units:
            names = ", ".join(f"`{unit.function.__qualname__}`" for unit in self.stage_one.units.values())
            raise RematError(
                f"remat({self.region}): a gradient of a gradient through the custom torch.autograd.Function {names}: "
                "remat traced its backward as ops whose own derivatives are those of its forward's ops, not of the "
                "Function, so the second gradient would be wrong. Take the inner gradient outside the remat'd "
                "function, or apply remat to code without the Function."
            )
        full, cotangent_outputs, residuals = self._second_order_reading(reading, strides=strides)
        unkept = self._unkept(full, residuals, reading, held)
        if unkept:  # recomputing what the first-order forward kept needs more: read what it kept
            full, cotangent_outputs, residuals = self._second_order_reading(reading, as_eager=False, strides=strides)
            unkept = self._unkept(full, residuals, reading, held)
        if unkept:
            raise RematError(
                f"remat({self.region}): this second-order gradient (a backward of a backward) needs "
                f"{', '.join(unkept)}, which the first-order backward did "
                "not need, so remat did not keep it. Nest torch.func transforms instead "
                "(grad(grad(...)), jacrev(jacrev(...)), hessian): remat sees the nesting when it traces "
                "and keeps what second order needs; or use a policy that keeps more for this region."
            )
        full_residuals = full.residual_outputs[: len(full.residual_outputs) - len(full.replayed)]
        read_at = self.n_first_order_kept + len(self.extra_inputs)  # the outputs read come after every saved tensor
        read = sorted(reading)
        order = [
            self.part.saved_inputs.index(i) if i in self.part.saved_inputs
            else self.n_first_order_kept + self.extra_inputs.index(i) if i in self.extra_inputs
            else read_at + len(read) + held.index(i)
            for i in full.saved_inputs
        ]
        offset = len(self.part.saved_inputs)
        order += [offset + residuals.index(j) if j in residuals else read_at + read.index(j) for j in full_residuals]
        order += [offset + len(residuals) + self.part.replayed.index(k) for k in full.replayed]
        return full, order, cotangent_outputs


_LAYOUTS = 8  # gradient layouts a plan traces a backward for; later ones are made contiguous
_UNBUILT = object()


def _built_once(table: dict[Any, Any], key: Any, build: Callable[[], Any], region: str) -> Any:
    """`table[key]`, built the first time (one trace at a time in the process): a backward
    traced for a gradient layout, or None where building it fails (a RematError the
    contiguous one raises too, or a derivative reading memory a broadcast gradient does not
    have: the contiguous backward serves) or the table holds `_LAYOUTS` layouts already."""
    built = table.get(key, _UNBUILT)
    if built is not _UNBUILT:
        return built
    with TRACE_LOCK, dispatch_modes_off(), fake_tensor_cache_bounded():
        if key in table or len(table) >= _LAYOUTS:
            return table.get(key)
        try:
            built = build()
        except Exception as error:
            logger.debug("remat(%s): no backward traced for gradients laid out %s: %s", region, key, error)
            built = None
        table[key] = built
    return built


def _strides_of(grads: Sequence[torch.Tensor | None]) -> Strides | None:
    """The key of a backward traced for these gradients' layouts; None where one sits at a
    storage offset (backwards are traced at offset 0, the layout of a copy)."""
    if any(g is not None and g.storage_offset() for g in grads):
        return None
    return tuple(None if g is None or g.is_contiguous() else tuple(g.stride()) for g in grads)


def eager_under_transforms(stage_one: StageOne, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether, called under torch.func transforms with these inputs, the region must run
    as it is, without remat, to be exact; four cases, all rare:
    - torch's generated vmap rule runs the backward per batch element and sums what
      unbatched inputs get, so an output computed from unbatched inputs only (batched by
      nothing; a draw under `randomness="different"` is batched), whose one cotangent every
      element's backward reads, would add to those inputs' gradients batch-size times;
    - under `randomness="different"`, an in-place random fill: eager `empty_like(x).uniform_()`
      draws per element when `x` is batched, where remat's graph draws into a fresh tensor
      vmap does not batch; eager `torch.empty(3, 4).uniform_()` raises (an unbatched tensor
      cannot be filled differently per element), which running the region as it is repeats;
      under `randomness="same"`, the in-place fill of a batched tensor whose memory order is
      not its logical order (`(x.mT * 1).uniform_()`): vmap draws it in logical order, where
      remat's graph draws in memory order, as eager code does outside vmap;
    - an in-place write of a value batched at some vmap's level into a tensor that is not
      (eager code refuses it: "output with shape [3] doesn't match the broadcast shape
      [2, 3]"), which remat's functional graph would compute: running the region as it is
      raises as eager code does;
    - under a gradient transform, an in-place write into an input (or a view of one) the
      transform does not track, such as a tensor the region closes over (eager code refuses
      it: "attempted to call in-place operation ... that would mutate a captured Tensor"),
      which remat's graph would apply after the call: again, it raises as eager code does."""
    if torch.compiler.is_compiling() or not transforms_active():  # dynamo resuming after a break: no vmap
        return False
    if stage_one.fills_like and any(has_batched_level(t) for t in inputs):
        draws = {kind for _, kind in active_vmaps()}  # each vmap's randomness
        if "different" in draws or (stage_one.fills_permuted and "same" in draws):
            return True
    if stage_one.in_place_writes and _writes_batched_into_unbatched(stage_one.in_place_writes, inputs):
        return True
    if any(
        write.target_input is not None and untracked_by_a_gradient_transform(inputs[write.target_input])
        for write in stage_one.in_place_writes
    ):
        return True
    vmap = innermost_vmap()
    if vmap is None:
        return False
    level, randomness = vmap
    batched = tuple(batched_at(t, level) for t in inputs)
    if all(batched) or not any(needs and not b for needs, b in zip(stage_one.input_needs_grad, batched)):
        return False
    return _output_of_unbatched_inputs(stage_one.graph, tuple(stage_one.output_differentiable), batched, randomness)


def writes_into_shared_memory(stage_one: StageOne, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the region writes in place into an input that shares memory with another
    of its inputs (`f(x, x[0])` writing into `x[0]`): eager code reads the write through
    the other tensor, where remat's graph takes its inputs as values of their own, so the
    region must run as it is to be exact. Rare; one tensor passed as several arguments is
    one input of the graph instead (`_trace/arguments.aliases`)."""
    if not stage_one.mutated:
        return False
    storages = [_storage_address(t) for t in inputs]
    for i in stage_one.mutated:
        written = storages[i]
        if written and any(s == written and inputs[j] is not inputs[i] for j, s in enumerate(storages)):
            return True
    return False


def _storage_address(t: torch.Tensor) -> int:
    """Where `t`'s memory starts (under torch.func wrappers, the tensor they wrap); 0 for
    none (an empty tensor, a tensor without storage)."""
    try:
        return int(unwrap_transforms(t).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def as_returned(
    results: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], as_is: Sequence[tuple[int, bool, int]]
) -> list[torch.Tensor]:
    """The region's results with the outputs eager code returns as the objects it has
    (`StageOne.returned_as_is`) being those objects: the input itself, or the value
    returned earlier. The Function's own outputs there get no gradient, so none is lost."""
    results = list(results)
    for j, from_input, k in as_is:
        results[j] = inputs[k] if from_input else results[k]
    return results


def _writes_batched_into_unbatched(writes: Sequence[InPlaceWrite], inputs: Sequence[torch.Tensor]) -> bool:
    """Whether, at some active vmap's level, one of `writes` puts a batched value into an
    unbatched tensor (a draw under `randomness="different"` is batched)."""
    for level, randomness in active_vmaps():
        batched = [batched_within(t, level) for t in inputs]
        different = randomness == "different"
        for write in writes:
            target = (write.target_random and different) or any(batched[i] for i in write.target_inputs)
            if not target and ((write.value_random and different) or any(batched[i] for i in write.value_inputs)):
                return True
    return False


@functools.lru_cache(maxsize=256)
def _output_of_unbatched_inputs(
    gm: torch.fx.GraphModule, differentiable: tuple[bool, ...], batched: tuple[bool, ...], randomness: str
) -> bool:
    """Whether a differentiable output of `gm` is computed from unbatched inputs only."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    reached = {n for n, b in zip(placeholders, batched) if b}
    for node in graph.nodes:
        if node.op == "call_function" and (
            any(i in reached for i in node.all_input_nodes) or (randomness == "different" and is_random(node))
        ):
            reached.add(node)
    outs = next(n for n in graph.nodes if n.op == "output").args[0]
    return any(d and isinstance(out, torch.fx.Node) and out not in reached for out, d in zip(outs, differentiable))


def _picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function giving the items at `positions` of a sequence, as a tuple (in C for two or more)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if not positions:
        return _pick_none
    at = positions[0]

    def pick_one(items: Sequence[Any]) -> tuple[Any, ...]:
        return (items[at],)

    return pick_one


def _pick_none(items: Sequence[Any]) -> tuple[Any, ...]:
    return ()


def _second_run(checked: dict[int, Callable[..., Any]], gm: torch.fx.GraphModule, *inputs: Any) -> Any:
    """A graph's second run: from now on it runs through its direct code (built now, not on
    the first run, so a size seen once, as in a variable-length loop, never pays for it:
    about 4 ms for a Llama layer's forward and backward graphs)."""
    direct = checked[id(gm)] = direct_code(gm)
    return direct(*inputs)


class RematFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(plan: Plan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        if plan.more_uses:  # the inputs taken again are there for their gradients only
            inputs = inputs[: len(inputs) - len(plan.more_uses)]
        return tuple(plan.run(plan.part.forward, *inputs))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        plan: Plan = inputs[0]
        args = inputs[1:]
        ctx.plan = plan
        kept_inputs, kept_outputs = plan.kept_pickers
        if plan.extra_inputs:
            ctx.save_for_backward(*kept_inputs(args), *kept_outputs(output), *[args[i] for i in plan.extra_inputs])
        else:
            ctx.save_for_backward(*kept_inputs(args), *kept_outputs(output))
        if plan.nondifferentiable_outputs:
            ctx.mark_non_differentiable(*[output[j] for j in plan.nondifferentiable_outputs])
        ctx.set_materialize_grads(False)
        if not plan.builds_graph:  # weakly: what a backward that builds a graph reads of them (`outputs_to_read`)
            ctx.outputs = [(j, weakref.ref(output[j]), output[j]._version) for j in plan.float_outputs]
            if plan.unkept_inputs:  # and the inputs it may recompute from (`held_inputs`)
                ctx.inputs = [(i, weakref.ref(args[i]), args[i]._version) for i in plan.unkept_inputs]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: Plan = ctx.plan
        kept = ctx.saved_tensors
        second_order = len(grads) > plan.n_outputs and any(g is not None for g in grads[plan.n_outputs:])
        # a backward that builds a graph (create_graph=True) runs the derivatives eager code then runs
        builds_graph = torch.is_grad_enabled() and not plan.builds_graph and not plan.part.offloaded
        # outside torch.func (whose levels hold other tensors), what is read of the caller's outputs
        readable = outputs_to_read(ctx) if (builds_graph or second_order) and not plan.builds_graph else {}
        if second_order or builds_graph:
            if plan.part.offloaded:
                raise RematError(
                    f"remat({plan.region}): this second-order gradient (a backward of a backward) would "
                    "differentiate through values the policy offloaded to host memory, which remat does not "
                    "support. Nest torch.func transforms instead (remat then keeps those values where they "
                    "are), or use a policy that keeps or recomputes them."
                )
            held = held_inputs(ctx) if not plan.builds_graph else {}
            laid_out = plan.laid_out_higher_order(frozenset(readable), tuple(held), grads)
            full, order, cotangent_outputs = laid_out or plan.higher_order(frozenset(readable), tuple(held))
            read = _read_outputs(plan, readable, order, len(kept)) if readable else []
            sources = (*kept, *read, *held.values()) if readable or held else kept
            as_given = laid_out is not None
            backward, cotangents = plan.backward_for(full.backward, grads, cotangent_outputs, kept, as_given)
            input_grads = plan.run(backward, *[sources[k] for k in order], *cotangents)
            # one gradient per use, as in first order (`vjp_of_graph`), or one per input, all for its first use
            positions = plan.gradient_positions if len(input_grads) == len(plan.gradient_positions) else plan.diff_inputs
        else:
            backward, tangents = plan.backward_for(plan.part.backward, grads, plan.float_outputs, kept)
            first_order = kept if len(kept) == plan.n_first_order_kept else kept[: plan.n_first_order_kept]
            input_grads = plan.run(backward, *first_order, *tangents)
            if plan.every_input_differentiable:
                return (None, *input_grads)
            positions = plan.gradient_positions
        result: list[torch.Tensor | None] = [None] * (len(plan.stage_one.input_values) + len(plan.more_uses) + 1)
        for i, g in zip(positions, input_grads):
            result[i + 1] = g
        return tuple(result)


def outputs_to_read(ctx: Any) -> dict[int, tuple[torch.Tensor | None, str | None]]:
    """The region's outputs with tensor hooks or `retain_grad` that a backward that builds a
    graph reads as the caller's tensors, by position; with why it cannot, those it cannot
    read (changed in place since, or no longer held by anyone).

    In eager code the derivative of an op that saves its output (tanh, exp, softmax) reads
    that very tensor, so a gradient of the gradient passes the output: its tensor hooks and
    `retain_grad` run. Read the same way, remat's do too. Hooks are seen in the tables the
    node notes (`note_hook_tables`), which outlive the outputs. (Reading every output at
    hand would make the output's second-order terms meet as in eager where the loss is not
    linear in it, but send them through the region's node, apart from the terms the
    rebuilt graph adds: under autocast inside the region, a cast of an input then adds
    its terms in two sums where eager's adds them in one, off by more than bf16 rounding.)"""
    readable: dict[int, tuple[torch.Tensor | None, str | None]] = {}
    tables = getattr(ctx, "hook_tables", {})
    for j, ref, version in ctx.outputs:
        tensor = ref()
        if not (tables.get(j) or (tensor is not None and (has_tensor_hooks(tensor) or tensor.retains_grad))):
            continue  # read or recomputed, the same value: recomputed, as it is where nothing is hooked
        if tensor is None:
            readable[j] = (None, "no longer held by anything")
        elif tensor._version == version:
            readable[j] = (tensor, None)
        else:
            readable[j] = (tensor, "modified in place since the region ran")
    return readable


def held_inputs(ctx: Any) -> dict[int, torch.Tensor]:
    """The inputs first order did not keep that are still alive and unchanged since the
    region ran, by position (in order)."""
    held: dict[int, torch.Tensor] = {}
    for i, ref, version in getattr(ctx, "inputs", ()):
        tensor = ref()
        if tensor is not None and tensor._version == version:
            held[i] = tensor
    return held


def _read_outputs(
    plan: Plan, readable: dict[int, tuple[torch.Tensor | None, str | None]], order: Sequence[int], n_kept: int
) -> list[torch.Tensor | None]:
    """The outputs a higher-order backward reads after the `n_kept` saved tensors, in order;
    one it reads but cannot have raises, naming why."""
    reading = sorted(readable)
    for k in order:
        if not n_kept <= k < n_kept + len(reading):  # a saved tensor, or a held input after the outputs read
            continue
        j = reading[k - n_kept]
        why = readable[j][1]
        if why is not None:
            raise RematError(
                f"remat({plan.region}): output {j} carries a tensor hook (or retain_grad), and this backward builds "
                "a graph (create_graph=True) whose derivative reads the output itself, as eager autograd's does "
                f"(its op saved it), so that a gradient of this gradient passes the hook. The output is {why}, "
                "so remat cannot read it. Keep a reference to the output, unchanged, until the backward (modify a "
                "clone of it instead), or put the hook on a tensor computed from it."
            )
    return [readable[j][0] for j in reading]


note_hook_tables(RematFunction._backward_cls)  # type: ignore[attr-defined]


def _cache_forward_signature() -> None:
    """Function.apply (called under torch.func transforms) binds its arguments to
    `forward`'s signature on every call; a precomputed `__signature__` makes computing
    the signature a lookup (torch 2.13, autograd/function.py apply)."""
    forward = RematFunction.forward
    forward.__signature__ = inspect.signature(forward)  # type: ignore[attr-defined]


_cache_forward_signature()
