"""Random-program differential tester for remat.

From an integer seed, `generate` writes a small random program as Python source: a function
over float64 tensors built from aten-level ops and the Python constructs that trip a tracer
(grad-mode blocks, module and tensor hooks, reseeding, random fills, side effects, nested
regions), with a random policy and one or two torch.func transforms. The oracle is the same
source run without remat. Some programs run in bfloat16, or in float32 under bfloat16
autocast, and are compared bitwise: remat promises eager's aten ops in eager's dtypes and
order, and low precision is where another order or dtype shows. Source text, not closures, so that a failing program is saved as a
standalone file (tests/support/differential_harness.py, then the program) that runs exactly what
failed.

    python tests/support/differential.py --seed N     # the standalone file of seed N
    python tests/support/differential.py --run N      # seed N's outcome
    python tests/support/differential.py --shrink N   # the fewest constructs that still fail
    python tests/support/differential.py --survey START COUNT   # outcomes, failures by constructs
"""

from __future__ import annotations

import argparse
import linecache
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import differential_harness as harness

HARNESS_PATH = Path(harness.__file__)
REPRO_NAME = "repro_seed_{seed}.py"

INPUTS = ("x", "y", "w")  # x and y are [3, 4]; w is [4, 4] and only ever a matrix operand
TRANSFORMS = {
    "backward": 3,
    "grad": 2,
    "vjp": 2,
    "vmap_grad": 2,
    "grad_grad": 1,
    "double_backward": 1,
    "jacrev": 1,
    "jvp": 1,
}
# The dtype a program runs in, with weights: float64 compared with a tolerance, the others
# bitwise. bfloat16 keeps float32's exponent range, so the ops below stay finite in it.
PRECISIONS = {"float64": 75, "bfloat16": 15, "autocast": 10}
AUTOCAST = 'torch.autocast("cpu", dtype=torch.bfloat16)'  # over float32 inputs
# Where the autocast block is: around the region's call in the loss (forward only, as
# training code writes it), inside the region, or around the whole transform (its
# backward too).
AUTOCAST_AT = ("main", "body", "call")
# How the loss that `.backward()` and torch.func's gradient transforms differentiate reads
# the region's output, so how the gradient the region's backward gets is laid out (eager's
# derivatives run on it as it is): `(out * cot).sum()` gives a contiguous one;
# `(out.mT * cot.mT.contiguous()).sum()` the same values transposed; `(out.sum() * 0.3)` a
# broadcast one (every stride 0). Drawn from a stream of its own, so that adding it
# changed no program's other draws.
GRADIENT_LAYOUTS = {
    "contiguous": "(out * cot).sum()",
    "transposed": "(out.mT * cot.mT.contiguous()).sum()",
    "broadcast": "(out.sum() * 0.3)",
}
# How `main` calls the region, drawn (with weights) from a stream of its own, so that adding
# it changed no program's other draws: on the inputs as they are; on the same values laid
# out otherwise (x and w with transposed strides, y at a storage offset); twice, the second
# time with x and y swapped (two autograd nodes add w's gradient); chained (the first
# output fed to a second call); with y's argument the x tensor itself (aliased inputs).
CALL_PATTERNS = {"once": 4, "laid_out": 1, "twice": 1, "chained": 1, "aliased": 1}
LAID_OUT = "x.mT.contiguous().mT, torch.cat([y.new_zeros(1, 4), y])[1:], w.mT.contiguous().mT"
# vmap's randomness: "same" with a batched input to a functional random op raises without
# remat too (both raise); an in-place fill of a batched tensor draws one row for all.
RANDOMNESS = ("different", "same")

# Each op maps [3, 4] operands ({a}, {b}) and the [4, 4] input w to a [3, 4] result, so any
# sequence composes. Arguments of sqrt, log, exp, division and prod are kept in range.
UNARY = {
    "sin": "torch.sin({a})",
    "cos": "torch.cos({a})",
    "tanh": "torch.tanh({a})",
    "exp": "torch.exp({a}.clamp(-3, 3))",
    "sigmoid": "torch.sigmoid({a})",
    "relu": "torch.relu({a})",
    "gelu": "F.gelu({a})",
    "silu": "F.silu({a})",
    "softplus": "F.softplus({a})",
    "abs": "torch.abs({a})",
    "neg": "-{a}",
    "square": "torch.square({a})",
    "sqrt": "torch.sqrt({a}.abs() + 1)",
    "log1p": "torch.log1p({a}.abs())",
    "erf": "torch.erf({a})",
    "atan": "torch.atan({a})",
    "reciprocal": "torch.reciprocal(1 + {a} * {a})",
    "pow": "torch.pow({a}, 3) / 4",
    "softmax": "torch.softmax({a}, -1)",
    "log_softmax": "F.log_softmax({a}, 0)",
    "logsumexp": "{a} - torch.logsumexp({a}, -1, keepdim=True)",
    "mean": "{a} - {a}.mean(0, keepdim=True)",
    "norm": "{a} / (1 + {a}.norm(dim=-1, keepdim=True))",
    "var": "{a} * {a}.var(0, keepdim=True)",
    "cumsum": "torch.cumsum({a}, 1) / 4",
    "layer_norm": "F.layer_norm({a}, (4,))",
    "transpose": "{a}.t().reshape(3, 4)",
    "reshape": "{a}.reshape(4, 3).t()",
    "view": "{a}.reshape(12).view(2, 6).view(3, 4)",
    "permute": "{a}.unsqueeze(0).permute(0, 2, 1).squeeze(0).t()",
    "squeeze": "{a}.unsqueeze(1).squeeze(1) * 1.5",
    "expand": "{a}[:, :1].expand(3, 4) * {a}",
    "flip": "torch.flip({a}, [0])",
    "roll": "torch.roll({a}, 1, 1)",
    "chunk": "torch.cat(torch.chunk({a}, 2, 1)[::-1], 1)",
    "split": "torch.cat(torch.split({a}, [1, 3], 1)[::-1], 1)",
    "narrow": "torch.narrow({a}, 1, 1, 2).repeat(1, 2)",
    "step_slice": "torch.cat([{a}[:, ::2], {a}[:, 1::2]], 1)",
    "index_select": "torch.index_select({a}, 1, torch.tensor([3, 1, 0, 2]))",
    "gather": "torch.gather({a}, 1, torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0], [1, 1, 2, 2]]))",
    "mm": "torch.mm({a}, w)",
    "matmul": "torch.matmul({a}, w)",
    "matmul_op": "{a} @ w",
    "bmm_w": "torch.bmm({a}.reshape(3, 1, 4), w.expand(3, 4, 4)).reshape(3, 4)",
    "einsum": "torch.einsum('ij,jk->ik', {a}, w)",
    "linear": "F.linear({a}, w)",
}
BINARY = {
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / (1 + {b} * {b})",
    "maximum": "torch.maximum({a}, {b})",
    "minimum": "torch.minimum({a}, {b})",
    "atan2": "torch.atan2({a}, {b}.abs() + 1)",
    "where": "torch.where({a} > {b}, {a}, {b} * 2)",
    "pow_int": "{a} * {b} ** 2",
    "sum_gate": "{a} * torch.sigmoid({b}.sum(-1, keepdim=True))",
    "amax": "{a} * {b}.amax(1, keepdim=True)",
    "prod": "{a} * torch.prod(torch.tanh({b}) * 0.5 + 1, -1, keepdim=True)",
    "cat": "torch.cat([{a}[:, 2:], {b}[:, :2]], 1)",
    "stack": "torch.stack([{a}, {b}]).mean(0)",
    "linear_bias": "F.linear({a}, w, {b}[0])",
    "addmm": "torch.addmm({b}, {a}, w)",
    "attention": "torch.softmax({a} @ {b}.t() / 2, -1) @ {b}",
    "bmm": "torch.bmm({a}.reshape(3, 2, 2), {b}.reshape(3, 2, 2)).reshape(3, 4)",
    "einsum_batched": "torch.einsum('bij,bjk->bik', {a}.reshape(3, 1, 4), {b}.reshape(3, 4, 1)).reshape(3, 1) * {a}",
    "layer_norm_affine": "F.layer_norm({a}, (4,), {b}[0], {b}[1])",
}
# Ops low-precision programs leave out, each with the reason (the README names it).
NOT_IN_LOW_PRECISION = {
    "prod": "eager's derivative takes a shorter formula when no element is zero, which a graph traced "
    "without data cannot know; in bf16 the two round apart, by more than any tolerance where a sum cancels",
}
NOT_UNDER_AUTOCAST = {
    "layer_norm_affine": "bf16 weights for a float32 input: eager raises outside vmap and runs under it "
    "(its batching rule decomposes), where remat's graph, traced outside, raises",
}
# Ops that bfloat16 autocast runs in bfloat16 on CPU: an autocast program starts with one.
AUTOCAST_OPS = (
    "mm",
    "matmul",
    "matmul_op",
    "bmm_w",
    "einsum",
    "linear",
    "linear_bias",
    "addmm",
    "attention",
    "bmm",
    "einsum_batched",
)
RANDOM = (
    "F.dropout({a}, p=0.3, training=True)",
    "{a} + 0.1 * torch.randn_like({a})",
    "{a} * torch.rand_like({a})",
    "{a} * torch.bernoulli(torch.full_like({a}, 0.6))",
)
# In-place random fills of a fresh tensor (made like a value, so batched under vmap, or a
# factory's, which vmap with randomness="different" refuses to fill without remat too) and
# of a computed one (whose gradient the fill cuts).
RANDOM_FILL = (
    "{a} * torch.empty_like({a}).uniform_()",
    "{a} + 0.1 * {a}.new_empty({a}.shape).normal_()",
    "({a} * 1).bernoulli_(0.5) * {a}",
    "{a} * torch.zeros_like({a}).exponential_()",
    "{a} * {a}.new_empty({a}.shape).random_(3, 10) / 10",
    "({a} * 1).uniform_(-1, 1) + {a}",
    "({a} + 1).normal_(0, 0.5) * {a}",
    "{a} * {a}.new_empty(3, 4).log_normal_(0, 0.25)",
    "{a} * torch.empty_like({a}).geometric_(0.5) / 4",
    "{a} * torch.empty(3, 4, dtype={a}.dtype).uniform_()",
)
FACTORY = (
    "torch.randn(3, 3, dtype=D) @ {a}",
    "{a} @ torch.randn(4, 4, dtype=D)",
    "{a} * torch.rand(3, 4, dtype=D)",
    "{a} * torch.arange(12, dtype=D).reshape(3, 4) / 12",
)
# In-place ops on a fresh value t (a * 1, or a contiguous clone of a for the views); those
# reading b need b's inputs among a's (else a transform refuses to write a wrapped value
# into a less wrapped one, without remat too).
INPLACE = ("{t}.mul_(2)", "{t}.sin_()", "{t}.clamp_(-1, 1)", "{t}.sigmoid_()", "{t}.add_({b})", "{t}.mul_({b}).tanh_()")
INPLACE_VIEW = (
    "{t}[:, 1:3].mul_(2)",
    "{t}.diagonal().sin_()",
    "{t}.view(12)[::2].neg_()",
    "{t}.t()[0].add_({b}[:, 0])",
    "{t}.narrow(1, 0, 2).mul_({b}[:, :2])",
)
# The second output of a two-output body, which only vjp differentiates: some with an
# infinite derivative where relu is zero, which a zero cotangent must not turn into NaN;
# or the value itself (an input returned unchanged: its gradient joins those of its uses).
AUX = ("torch.tanh({a})", "torch.sqrt(torch.relu({a}))", "torch.relu({a}) ** 1.5", "torch.log(torch.relu({a}))", "{a}")
ACTIVATIONS = {"Tanh": "torch.tanh", "GELU": "F.gelu", "SiLU": "F.silu", "Sigmoid": "torch.sigmoid"}  # module: function
# A custom autograd.Function's hand-written backward: what setup_context saves, and the
# gradients of its operands a and b (w gets none). None is the forward's derivative, so a
# region that differentiated the forward instead of running the backward would differ.
CUSTOM_BACKWARDS = {
    "straight": ("a", "g, None"),  # straight-through for a; b gets no gradient
    "inputs": ("a, b", "g * torch.cos(a), g * b"),
    "output": ("out", "g * (1 - out * out), g * 0.5"),
}
# Updates of tensors the region closes over, as a norm layer's running statistics and
# counters: in place, with grad off, then read. A counter's update reads no input, so it
# runs under every transform; a statistic's reads a value, which a transform refuses to
# write into a tensor it does not track (without remat too).
BUFFER_UPDATES = {
    "count": ("with torch.no_grad():", "    count.add_(1)", "{v} = {a} * (1 + count / 8)"),
    "running": ("with torch.no_grad():", "    stats.mul_(0.9).add_({a}.mean(0) * 0.1)", "{v} = {a} + stats"),
    "detached": ("", "stats.mul_(0.5).add_({a}.detach().sum(0))", "{v} = {a} * stats.tanh()"),
    "view": ("with torch.no_grad():", "    stats[1:3].mul_(0.9).add_({a}[0, :2] * 0.1)", "{v} = {a} * stats"),
}
NAMES = ("h", "g")

# Constructs: each adds source lines that have a plain rendering, used when it is turned
# off (to shrink a failure to the constructs that cause it). A construct in REQUIRES is
# drawn with the one it needs, and renders plain when that one is off.
CONSTRUCTS = (
    "no_grad",
    "set_grad_enabled",
    "enable_grad_in_no_grad",
    "no_grad_helper",
    "module",
    "module_hooks",
    "global_module_hook",
    "tensor_hook",
    "fork_rng",
    "freeze_rng_state",
    "reseed_no_restore",
    "list_append",
    "append_tensor",
    "attr_set",
    "nonlocal_assign",
    "nested_region",
    "checkpoint_name",
    "random_op",
    "random_fill",
    "factory",
    "inplace",
    "inplace_view",
    "two_outputs",
    "custom_function",
    "buffer_update",
)
REQUIRES = {"module_hooks": "module", "global_module_hook": "module"}


def reads_w(source: str) -> bool:
    return re.search(r"\bw\b", source) is not None


def _policies(names: tuple[str, ...], factory: bool) -> list[str]:
    """Policy expressions a region may get; name policies use names the program tags."""
    a, b = (names + NAMES)[:2]
    choices = [
        "None",
        "P.nothing_saveable",
        "P.everything_saveable",
        "P.dots_saveable",
        "P.dots_with_no_batch_dims_saveable",
        "P.dots_and_attention_saveable",
        f"P.save_only_these_names({a!r})",
        f"P.save_any_names_but_these({b!r})",
        f"P.save_from_both_policies(P.dots_with_no_batch_dims_saveable, P.save_only_these_names({a!r}))",
        "P.memory_budget(0.25)",
        "P.memory_budget(0.5)",
        "P.memory_budget(0.75)",
        "P.output_smaller_than(100)",
        "P.output_smaller_than(64)",
    ]
    if factory:  # a factory in the region is what output_smaller_than must not run for real
        choices += ["P.output_smaller_than(100)"] * 4
    return choices


@dataclass(frozen=True)
class Value:
    name: str
    inputs: frozenset[str]  # the inputs it is computed from
    grad_inputs: frozenset[str]  # those it is differentiable in (not through no_grad)


@dataclass(frozen=True)
class Program:
    seed: int
    constructs: frozenset[str]  # those on
    transforms: tuple[str, ...]
    policy: str
    precision: str  # a key of PRECISIONS
    random: bool  # whether it draws random numbers (a reseeding construct turned off still does)
    source: str  # the program section of a standalone file: imports and make_program

    def standalone(self) -> str:
        """A file that runs this program's comparison and asserts it is acceptable."""
        main = (
            '\n\nif __name__ == "__main__":\n'
            "    outcome, detail = check(make_program, CONSTRUCTS, EXACT)\n"
            f'    print(f"seed {self.seed}: {{outcome}} {{detail}}")\n'
            "    assert outcome in ACCEPTABLE, detail\n"
        )
        header = (
            f"# remat differential repro, seed {self.seed}: transforms {', '.join(self.transforms)}; "
            f"policy {self.policy}; {self.precision}.\n# Run it with `python {REPRO_NAME.format(seed=self.seed)}`; "
            "it asserts that remat matches the same program without remat.\n"
        )
        return header + HARNESS_PATH.read_text() + "\n\n# The program.\n" + self.source + main


class _Builder:
    """Draws one program from a seeded generator. Every draw happens whichever constructs
    are off, so turning one off changes only its own lines."""

    def __init__(self, seed: int, off: frozenset[str]) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.off = off
        self.setup: list[str] = []
        self.body: list[str] = []
        self.values: list[Value] = []
        self.consumed: set[str] = set()
        self.count = 0
        self.names: list[str] = []
        self.random = False

    def on(self, construct: str) -> bool:
        required = REQUIRES.get(construct)
        return construct in self.chosen and construct not in self.off and (required is None or self.on(required))

    def fresh(self) -> str:
        self.count += 1
        return f"v{self.count}"

    def pick(self, among: Iterable[Value] | None = None, consume: bool = True) -> Value:
        """An operand, most often one of the latest values; consumed ones are not summed
        into the output."""
        pool = list(among if among is not None else self.values)
        recent = pool[-3:]
        value = self.rng.choice(recent if self.rng.random() < 0.7 else pool)
        if consume:
            self.consumed.add(value.name)
        return value

    def op(
        self, *, grad: bool = True, a: Value | None = None, among: tuple[str, ...] | None = None
    ) -> tuple[str, frozenset[str], frozenset[str]]:
        """A random op's expression (of the ops named `among`, if given) and the inputs it
        reads (differentiably)."""
        a = a or self.pick()
        left_out = {
            "float64": {}, "bfloat16": NOT_IN_LOW_PRECISION, "autocast": {**NOT_IN_LOW_PRECISION, **NOT_UNDER_AUTOCAST},
        }[self.drawn_precision]
        unary = {k: v for k, v in UNARY.items() if (among is None or k in among) and k not in left_out}
        binary = {k: v for k, v in BINARY.items() if (among is None or k in among) and k not in left_out}
        if self.rng.random() < 0.45:
            b = self.pick()
            expr = self.rng.choice(list(binary.values())).format(a=a.name, b=b.name)
            used = [a, b]
        else:
            expr = self.rng.choice(list(unary.values())).format(a=a.name)
            used = [a]
        if reads_w(expr):
            used.append(self.w)
        inputs = frozenset().union(*(v.inputs for v in used))
        grads = frozenset().union(*(v.grad_inputs for v in used)) if grad else frozenset()
        return expr, inputs, grads

    def assign(
        self,
        lines: list[str],
        indent: str,
        *,
        grad: bool = True,
        a: Value | None = None,
        among: tuple[str, ...] | None = None,
    ) -> Value:
        expr, inputs, grads = self.op(grad=grad, a=a, among=among)
        value = Value(self.fresh(), inputs, grads)
        lines.append(f"{indent}{value.name} = {expr}")
        return value

    def emit(self, lines: list[str], *values: Value) -> None:
        self.body.extend(lines)
        self.values.extend(values)

    def build(self) -> Program:
        rng = self.rng
        names, weights = list(TRANSFORMS), list(TRANSFORMS.values())
        first, second = rng.choices(names, weights, k=2)
        transforms = (first, second) if second != first and rng.random() < 0.3 else (first,)
        self.transforms = transforms
        chosen = set(rng.sample(CONSTRUCTS, rng.randint(2, 3)))
        chosen |= {REQUIRES[c] for c in chosen if c in REQUIRES}
        if "jvp" in transforms:  # forward mode: nothing requires grad, so register_hook raises without remat too
            chosen.discard("tensor_hook")
        self.chosen = frozenset(chosen)
        self.drawn_precision = rng.choices(list(PRECISIONS), list(PRECISIONS.values()))[0]
        self.precision = "float64" if "precision" in self.off else self.drawn_precision  # shrink turns it off
        self.autocast_at = rng.choice(AUTOCAST_AT)
        self.randomness = rng.choice(RANDOMNESS)
        self.gradient_layout = random.Random(f"gradient layout {self.seed}").choice(list(GRADIENT_LAYOUTS))
        patterns = random.Random(f"call pattern {self.seed}")
        drawn_pattern = patterns.choices(list(CALL_PATTERNS), list(CALL_PATTERNS.values()))[0]
        self.call_pattern = "once" if "call_pattern" in self.off else drawn_pattern  # shrink turns it off
        if "buffer_update" in self.chosen and self.call_pattern in ("twice", "chained"):
            # a second call changes the buffer the first call's backward reads: eager autograd
            # refuses, remat reads each call's value (tests/contract/test_python_channels.py)
            self.call_pattern = "once"
        second_order = {"grad_grad", "double_backward"} & set(transforms)
        if second_order and self.call_pattern == "chained" and self.precision != "float64":
            # a gradient of a gradient through the second call, nonlinear in the first's output:
            # not bitwise (README), and its low-precision rounding grows past any tolerance
            self.call_pattern = "once"

        # What each transform differentiates (always x), and which inputs vmap batches.
        self.argnums = (0,) + tuple(i for i in (1, 2) if rng.random() < 0.5)
        self.outer_argnums = (0,) + tuple(i for i in (1, 2) if rng.random() < 0.5)
        self.in_dims = (0, rng.choice((0, None)), rng.choice((0, None)))
        if None not in self.in_dims:
            self.in_dims = (0, 0, None) if rng.random() < 0.5 else (0, None, 0)
        differentiated = {INPUTS[i] for i in self.argnums}
        self.inputs = {n: Value(n, frozenset({n}), frozenset({n} & differentiated)) for n in INPUTS}
        self.w = self.inputs["w"]  # what `w` is where ops are being drawn: the body's or a local function's
        self.values = [self.inputs["x"], self.inputs["y"]]

        drawn_elsewhere = ("two_outputs", "module_hooks", "global_module_hook")  # by render and _module
        slots = ["op"] * rng.randint(0, 2) + sorted(c for c in self.chosen if c not in drawn_elsewhere)
        rng.shuffle(slots)
        for slot in ["first_op"] + slots:
            getattr(self, f"_{slot}")()

        policy = rng.choice(_policies(tuple(self.names), "factory" in self.chosen))
        self.policy = "None" if "policy" in self.off else policy
        constructs = frozenset(c for c in self.chosen if self.on(c))
        return Program(self.seed, constructs, transforms, self.policy, self.precision, self.random, self.render())

    # Slots: each appends body lines (and setup lines) for one op or construct.

    def _op(self) -> None:
        lines: list[str] = []
        self.emit(lines, self.assign(lines, ""))

    def _first_op(self) -> None:
        """An op; under autocast one that autocast runs in bfloat16, else the program could
        be float32 throughout."""
        lines: list[str] = []
        self.emit(lines, self.assign(lines, "", among=AUTOCAST_OPS if self.drawn_precision == "autocast" else None))

    def _block(self, construct: str, header: str) -> None:
        """An op inside the block that `header` opens, or plain."""
        on = self.on(construct)
        lines = [header] if on else []
        self.emit(lines, self.assign(lines, "    " if on else "", grad=False))

    def _no_grad(self) -> None:
        self._block("no_grad", "with torch.no_grad():")

    def _set_grad_enabled(self) -> None:
        if self.rng.random() < 0.5:
            self._block("set_grad_enabled", "with torch.set_grad_enabled(False):")
            return
        on = self.on("set_grad_enabled")
        lines = ["torch.set_grad_enabled(False)"] if on else []
        value = self.assign(lines, "", grad=False)
        lines += ["torch.set_grad_enabled(True)"] if on else []
        self.emit(lines, value)

    def _enable_grad_in_no_grad(self) -> None:
        on = self.on("enable_grad_in_no_grad")
        lines = ["with torch.no_grad():"] if on else []
        indent = "    " if on else ""
        first = self.assign(lines, indent, grad=False)
        self.values.append(first)
        if on:
            lines.append("    with torch.enable_grad():")
        second = self.assign(lines, indent * 2)
        self.emit(lines, second)

    def _local_function(self, lines: list[str]) -> Value:
        """An op of a function of (a, b, w), appended to `lines`: its result, with the
        parameters it reads as inputs."""
        saved = self.values, self.consumed, self.w
        self.values = [Value(n, frozenset({n}), frozenset({n})) for n in ("a", "b")]
        self.consumed, self.w = set(), Value("w", frozenset({"w"}), frozenset({"w"}))
        result = self.assign(lines, "    ")
        self.values, self.consumed, self.w = saved
        return result

    def _call(self, function: str, result: Value, grad: bool) -> None:
        """`v = function(a, b, w)` in the body, reading what `result` (the function's) reads,
        as differentiable as its operands if `grad`."""
        a, b = self.pick(), self.pick()
        operands = {"a": a, "b": b, "w": self.w}
        used = [operands[n] for n in sorted(result.inputs)]
        inputs = frozenset().union(*(v.inputs for v in used))
        grads = frozenset().union(*(v.grad_inputs for v in used)) if grad else frozenset()
        self.emit([f"{self.fresh()} = {function}({a.name}, {b.name}, w)"], Value(f"v{self.count}", inputs, grads))

    def _no_grad_helper(self) -> None:
        lines = ["@torch.no_grad()"] if self.on("no_grad_helper") else []
        lines.append("def helper(a, b, w):")
        result = self._local_function(lines)
        self.setup += lines + [f"    return {result.name}", ""]
        self._call("helper", result, grad=not self.on("no_grad_helper"))

    def _module(self) -> None:
        activation = self.rng.choice(list(ACTIVATIONS))
        self.setup.append(f"sub = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.{activation}())")
        self.setup.append("params = list(sub.parameters())")
        hooked = self.rng.choice(("sub", "sub[0]"))
        hooks = self.rng.choice((["forward"], ["pre"], ["forward", "pre"]))
        if self.on("module_hooks"):
            for kind in hooks:
                if kind == "forward":
                    hook, method = "lambda m, args, out: seen.append(out)", "register_forward_hook"
                else:
                    hook, method = "lambda m, args: seen.append(args[0])", "register_forward_pre_hook"
                self.setup.append(f"handles.append({hooked}.{method}({hook}))")
        if self.on("global_module_hook"):
            hook = "lambda m, args, out: seen.append((type(m).__name__, out))"
            self.setup.append(f"handles.append(torch.nn.modules.module.register_module_forward_hook({hook}))")
        a = self.pick()
        value = Value(self.fresh(), a.inputs, a.grad_inputs)
        if self.on("module"):
            call = f"sub({a.name})"
        else:  # the same computation without a module call
            call = f"{ACTIVATIONS[activation]}(F.linear({a.name}, sub[0].weight, sub[0].bias))"
        self.emit([f"{value.name} = {call}"], value)

    def _tensor_hook(self) -> None:
        hooked = [v for v in self.values if "x" in v.grad_inputs and v.name not in INPUTS]
        if not hooked:
            self._op()
            hooked = [v for v in self.values[-1:] if "x" in v.grad_inputs]
        if not hooked:
            return
        value = self.rng.choice(hooked)
        hook = self.rng.choice(("lambda g: g * 2", "lambda g: seen.append(g)"))
        if self.on("tensor_hook"):
            self.body.append(f"{value.name}.register_hook({hook})")

    def _reseeded(self, construct: str, header: list[str]) -> None:
        seed = self.rng.randint(1, 99)
        on = self.on(construct)
        a = self.pick()
        indent = "    " if header and on else ""
        lines = (header if on else []) + ([f"{indent}torch.manual_seed({seed})"] if on else [])
        value = Value(self.fresh(), a.inputs, a.grad_inputs)
        lines.append(f"{indent}{value.name} = {self.rng.choice(RANDOM).format(a=a.name)}")
        self.random = True
        self.emit(lines, value)

    def _fork_rng(self) -> None:
        self._reseeded("fork_rng", ["with torch.random.fork_rng():"])

    def _freeze_rng_state(self) -> None:
        self._reseeded("freeze_rng_state", ["with freeze_rng_state():"])

    def _reseed_no_restore(self) -> None:
        self._reseeded("reseed_no_restore", [])

    def _list_append(self) -> None:
        line = self.rng.choice(
            ("effects.append(len(effects))", "effects.append('called')", "effects.append(tuple({v}.shape))")
        )
        if self.on("list_append"):
            self.body.append(line.format(v=self.values[-1].name))

    def _append_tensor(self) -> None:
        line = self.rng.choice(("effects.append({v})", "effects.append({v}.detach())", "effects.append({v}.sum())"))
        if self.on("append_tensor"):
            self.body.append(line.format(v=self.pick(consume=False).name))

    def _attr_set(self) -> None:
        line = self.rng.choice(("state.calls += 1", "state.shape = tuple({v}.shape)", "state.calls = state.calls + 2"))
        if self.on("attr_set"):
            self.body.append(line.format(v=self.values[-1].name))

    def _nonlocal_assign(self) -> None:
        if self.on("nonlocal_assign"):
            self.body += ["nonlocal counter", "counter += 1"]

    def _nested_region(self) -> None:
        lines = ["def inner(a, b, w):"]
        result = self._local_function(lines)
        name = self.rng.choice(NAMES)
        self.names.append(name)
        lines.append(f"    {result.name} = remat.checkpoint_name({result.name}, {name!r})")
        self.setup += lines + [f"    return torch.tanh({result.name})", ""]
        # a budget chooses for a whole region: one nested in another is refused (tests/contract/test_budget.py)
        inner_policy = self.rng.choice([p for p in _policies(tuple(self.names), False) if "memory_budget" not in p])
        if self.on("nested_region"):
            self.setup += [f"inner = remat.remat(inner, policy={inner_policy}) if use_remat else inner"]
        self._call("inner", result, grad=True)

    def _custom_function(self) -> None:
        """`custom(a, b, w)`: a Function with setup_context and a generated vmap rule (as
        torch.func requires) whose backward is not its forward's derivative; one or two
        outputs, the second maybe non-differentiable. Plain: the forward as a function."""
        saved, gradients = CUSTOM_BACKWARDS[self.rng.choice(list(CUSTOM_BACKWARDS))]
        second = self.rng.choice((None, "differentiable", "non-differentiable"))
        forward: list[str] = []
        result = self._local_function(forward)
        returned = f"{result.name}, torch.tanh(a)" if second else result.name
        if self.on("custom_function"):
            out = "output[0]" if second else "output"
            lines = [
                "class Custom(torch.autograd.Function):",
                "    generate_vmap_rule = True",
                "",
                "    @staticmethod",
                "    def forward(a, b, w):",
                *(f"    {ln}" for ln in forward),
                f"        return {returned}",
                "",
                "    @staticmethod",
                "    def setup_context(ctx, inputs, output):",
                "        a, b, w = inputs",
                f"        out = {out}",
                *(["        ctx.mark_non_differentiable(output[1])"] if second == "non-differentiable" else []),
                f"        ctx.save_for_backward({saved})",
                "",
                "    @staticmethod",
                "    def backward(ctx, g, *more):",
                f"        {saved}, = ctx.saved_tensors",
                "        ga, gb = " + gradients,
                "        return ga + sum(more), gb, None",
                "",
                "custom = Custom.apply",
            ]
        else:
            lines = ["def custom(a, b, w):", *forward, f"    return {returned}"]
        self.setup += lines + [""]
        a, b = self.pick(), self.pick()
        flows_to_b = not gradients.endswith("None") if self.on("custom_function") else "b" in result.grad_inputs
        inputs = a.inputs | b.inputs | (self.w.inputs if "w" in result.inputs else frozenset())
        grads = a.grad_inputs | (b.grad_inputs if flows_to_b else frozenset())
        first = Value(self.fresh(), inputs, grads)
        if not second:
            self.emit([f"{first.name} = custom({a.name}, {b.name}, w)"], first)
            return
        other = Value(self.fresh(), a.inputs, a.grad_inputs if second == "differentiable" else frozenset())
        self.emit([f"{first.name}, {other.name} = custom({a.name}, {b.name}, w)"], first, other)

    def _buffer_update(self) -> None:
        """An in-place update of a closed-over tensor with grad off, then a read of it."""
        header, update, read = BUFFER_UPDATES[self.rng.choice(list(BUFFER_UPDATES))]
        a = self.pick()
        value = Value(self.fresh(), a.inputs, a.grad_inputs)
        lines = ([header] if header else []) + [update.format(a=a.name)] if self.on("buffer_update") else []
        self.emit(lines + [read.format(v=value.name, a=a.name)], value)

    def _checkpoint_name(self) -> None:
        if self.values[-1].name in INPUTS:
            self._op()
        value = self.values[-1]
        name = self.rng.choice(NAMES)
        self.names.append(name)
        if self.on("checkpoint_name"):
            self.body.append(f"{value.name} = remat.checkpoint_name({value.name}, {name!r})")

    def _random_op(self) -> None:
        template = self.rng.choice(RANDOM)
        self._templated(template if self.on("random_op") else "{a} * 0.5")

    def _random_fill(self) -> None:
        template = self.rng.choice(RANDOM_FILL)
        self.random = True
        self._templated(template if self.on("random_fill") else "{a} * 0.5")

    def _factory(self) -> None:
        template = self.rng.choice(FACTORY)
        self._templated(template if self.on("factory") else "{a} * 0.5")

    def _templated(self, template: str) -> None:
        self.random |= template in RANDOM or "torch.rand" in template
        a = self.pick()
        value = Value(self.fresh(), a.inputs, a.grad_inputs)
        self.emit([f"{value.name} = {template.format(a=a.name)}"], value)

    def _inplace(self) -> None:
        self._in_place("inplace", INPLACE, "{a} * 1")

    def _inplace_view(self) -> None:
        self._in_place("inplace_view", INPLACE_VIEW, "{a}.clone(memory_format=torch.contiguous_format)")

    def _in_place(self, construct: str, templates: tuple[str, ...], fresh: str) -> None:
        a = self.pick()
        template = self.rng.choice(templates)
        b = self.pick([v for v in self.values if v.inputs <= a.inputs]) if "{b}" in template else a
        t = f"t{self.count + 1}"
        value = Value(self.fresh(), a.inputs, a.grad_inputs | b.grad_inputs)
        lines = [f"{t} = {fresh.format(a=a.name)}"]
        if self.on(construct):
            lines.append(template.format(t=t, b=b.name))
        lines.append(f"{value.name} = {t}")
        self.emit(lines, value)

    # Rendering.

    def comparison(self) -> bool | str:
        """How the harness compares the program's results: bitwise (True) in low precision,
        within bf16 rounding ("bf16") where the README says remat is not bitwise, else with
        float64's tolerance (False)."""
        if self.precision == "float64":
            return False
        return "bf16" if self.comparison_reason() != "bitwise" else True

    def comparison_reason(self) -> str:
        if self.precision == "float64":
            return "with a tolerance"
        if self.precision == "autocast" and self.autocast_at == "call":
            return "within bf16 rounding: a backward run inside the autocast block (README)"
        if {"grad_grad", "double_backward"} & set(self.transforms):
            return "within bf16 rounding: a second-order gradient in low precision (README)"
        if self.precision == "autocast" and self.autocast_at != "body" and self.call_pattern in ("twice", "chained"):
            return "within bf16 rounding: w used by two calls of the region in one autocast context (README)"
        if self.precision == "autocast" and (self.on("inplace") or self.on("inplace_view")):
            return "within bf16 rounding: an in-place op under autocast (README)"
        return "bitwise"

    def render(self) -> str:
        leaves = [v for v in self.values if v.name not in self.consumed and v.name not in INPUTS] or self.values[-1:]
        if not any("x" in v.grad_inputs for v in leaves):  # else backward would have nothing to differentiate
            leaves.append(self.inputs["x"])
        result = " + ".join(v.name for v in leaves)
        body = list(self.body)
        two = self.on("two_outputs")
        # The second output, from an intermediate or from the first output.
        aux_of = self.rng.choice([v.name for v in self.values if v.name not in INPUTS] + ["out", "x"])
        aux = self.rng.choice(AUX).format(a=aux_of)
        if two:
            body += [f"out = {result}", f"return out, {aux}"]
        else:
            body.append(f"return {result}")
        autocast = self.precision == "autocast"
        if autocast and self.autocast_at == "body":
            body = [f"with {AUTOCAST}:"] + [f"    {ln}" for ln in body]
        dtype = {"float64": "torch.float64", "bfloat16": "torch.bfloat16", "autocast": "torch.float32"}[self.precision]
        freeze = ["from torch.testing._internal.common_utils import freeze_rng_state"]
        freeze = freeze if "freeze_rng_state" in self.chosen else []
        lines = [
            "import types",
            "",
            "import torch",
            "import torch.nn.functional as F",
            *freeze,
            "",
            "import remat",
            "from remat import policies as P",
            "",
            f"D = {dtype}",
            f"EXACT = {self.comparison()!r}  # {self.comparison_reason()}",
            f"SEED = {self.seed}",
            f"CONSTRUCTS = frozenset({sorted(c for c in self.chosen if self.on(c))!r})",
            "",
            "",
            "def make_program(use_remat):",
            '    """The program and all it closes over, made afresh for each run."""',
            "    torch.manual_seed(SEED)",
            "    x, y = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)",
            "    w = torch.randn(4, 4, dtype=D) / 2",
            "    cot, cot2 = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)",
            "    tx, ty, tw = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D), torch.randn(4, 4, dtype=D)",
            "    xb, yb = torch.randn(2, 3, 4, dtype=D), torch.randn(2, 3, 4, dtype=D)",
            "    wb = torch.randn(2, 4, 4, dtype=D)",
            "    seen, effects, handles = [], [], []",
            "    count, stats = torch.zeros((), dtype=D), torch.ones(4, dtype=D)",
            "    state = types.SimpleNamespace(calls=0)",
            "    counter = 0",
            "    params = []",
        ]
        lines += [""] if self.setup else []
        lines += ["    " + ln if ln else "" for ln in self.setup]
        lines += ["", "    def body(x, y, w):"] + [f"        {ln}" for ln in body]
        lines += ["", f"    f = remat.remat(body, policy={self.policy}) if use_remat else body", ""]
        call = ["        " + line for line in self._call_lines(two)]
        if autocast and self.autocast_at == "main":
            call = [f"        with {AUTOCAST}:", *("    " + line for line in call)]
        lines += [
            "    def main(x, y, w):",
            '        """The output the transforms differentiate, and the whole output as aux."""',
            *call,
            f"        return {'out[0]' if two else 'out'}, out",
            "",
            "    def loss(x, y, w):",
            "        out, whole = main(x, y, w)",
            f"        return {GRADIENT_LAYOUTS[self.gradient_layout]}, whole  # the gradient: {self.gradient_layout}",
            "",
        ]
        for name in self.transforms:
            lines += ["    " + ln if ln else "" for ln in self._transform(name, two)] + [""]
        wrap = "{t}"
        if autocast and self.autocast_at == "call":
            wrap = "under_autocast({t})"
            lines += [
                "    def under_autocast(call):",
                '        """The transform with its backward under autocast too."""',
                "",
                "        def autocast_call():",
                f"            with {AUTOCAST}:",
                "                return call()",
                "",
                "        return autocast_call",
                "",
            ]
        lines += [
            "    def close():",
            "        for handle in handles:",
            "            handle.remove()",
            "",
            f"    transforms = [{', '.join(f'({t!r}, {wrap.format(t=t)})' for t in self.transforms)}]",
            '    state_read = {"attributes": state, "counter": lambda: counter}',
            '    observed = {"seen": seen, "effects": effects, "state": state_read, "buffers": [count, stats]}',
            "    return transforms, observed, close",
        ]
        return "\n".join(lines) + "\n"

    def _call_lines(self, two: bool) -> list[str]:
        """How `main` calls the region `f` (see CALL_PATTERNS), leaving its result in `out`."""
        if self.call_pattern == "laid_out":
            return [f"out = f({LAID_OUT})  # the same values, laid out otherwise"]
        if self.call_pattern == "twice":
            added = "tuple(a + b for a, b in zip(first, second))" if two else "first + second"
            return ["first, second = f(x, y, w), f(y, x, w)  # two calls", f"out = {added}"]
        if self.call_pattern == "chained":
            return ["first = f(x, y, w)", f"out = f({'first[0]' if two else 'first'}, y, w)  # an output fed back in"]
        if self.call_pattern == "aliased":
            return ["out = f(x, x, w)  # one tensor as two arguments"]
        return ["out = f(x, y, w)"]

    def _transform(self, name: str, two: bool) -> list[str]:
        argnums = self.argnums if len(self.argnums) > 1 else self.argnums[0]
        outer = self.outer_argnums if len(self.outer_argnums) > 1 else self.outer_argnums[0]
        if name == "backward":
            flags = ", ".join(str(i in self.argnums) for i in range(3))
            return [
                "def backward():",
                f"    args = [t.clone().requires_grad_(r) for t, r in zip((x, y, w), ({flags}))]",
                "    out, whole = main(*args)",
                f"    {GRADIENT_LAYOUTS[self.gradient_layout]}.backward()  # the gradient: {self.gradient_layout}",
                "    grads = [t.grad for t in args + params]",
                "    for p in params:",
                "        p.grad = None",
                '    return {"out": whole, "grads": grads}',
            ]
        if name == "grad":
            return [
                "def grad():",
                f"    grads, whole = torch.func.grad(loss, argnums={argnums}, has_aux=True)(x, y, w)",
                '    return {"out": whole, "grads": grads}',
            ]
        if name == "vjp":
            return [
                "def vjp():",
                "    out, pullback = torch.func.vjp(f, x, y, w)",
                f'    return {{"out": out, "grads": pullback({"(cot, cot2)" if two else "cot"})}}',
            ]
        if name == "vmap_grad":
            args = ", ".join(f"{n}b" if d == 0 else n for n, d in zip(INPUTS, self.in_dims))
            return [
                "def vmap_grad():",
                f"    per_example = torch.func.grad(loss, argnums={argnums}, has_aux=True)",
                f"    batched = torch.func.vmap(per_example, in_dims={self.in_dims}, randomness={self.randomness!r})",
                f"    grads, whole = batched({args})",
                '    return {"out": whole, "grads": grads}',
            ]
        if name == "grad_grad":
            tangents = " + ".join(f"(g[{k}] * t{INPUTS[i]}).sum()" for k, i in enumerate(self.argnums))
            return [
                "def grad_grad():",
                "    def first(x, y, w):",
                f"        g, _ = torch.func.grad(loss, argnums={self.argnums}, has_aux=True)(x, y, w)",
                f"        return {tangents}",
                "",
                f'    return {{"grads": torch.func.grad(first, argnums={self.outer_argnums})(x, y, w)}}',
            ]
        if name == "double_backward":
            flags = ", ".join(str(i in self.argnums) for i in range(3))
            differentiated = ", ".join(f"args[{i}]" for i in self.argnums)
            tangents = " + ".join(f"(g[{k}] * t{INPUTS[i]}).sum()" for k, i in enumerate(self.argnums))
            return [
                "def double_backward():",
                '    """Second order through autograd: a create_graph=True backward, then .backward()."""',
                f"    args = [t.clone().requires_grad_(r) for t, r in zip((x, y, w), ({flags}))]",
                "    out, whole = main(*args)",
                "    # zeros for an input the output does not read",
                f"    g = torch.autograd.grad((out * cot).sum(), [{differentiated}], create_graph=True, materialize_grads=True)",
                "    # x * 0 keeps a graph where the first gradients are constants (a linear body)",
                f"    ({tangents} + (args[0] * 0).sum()).backward()",
                "    grads = [t.grad for t in args + params]",
                "    for p in params:",
                "        p.grad = None",
                '    return {"out": whole, "first": list(g), "grads": grads}',
            ]
        if name == "jacrev":
            return [
                "def jacrev():",
                f"    jac, whole = torch.func.jacrev(main, argnums={outer}, has_aux=True)(x, y, w)",
                '    return {"out": whole, "jacobian": jac}',
            ]
        assert name == "jvp"
        return [
            "def jvp():",
            "    out, tangent, whole = torch.func.jvp(main, (x, y, w), (tx, ty, tw), has_aux=True)",
            '    return {"out": whole, "tangent": tangent}',
        ]


def generate(seed: int, off: frozenset[str] = frozenset()) -> Program:
    """Seed `seed`'s program, with the constructs in `off` rendered plain."""
    return _Builder(seed, off).build()


@dataclass(frozen=True)
class Result:
    seed: int
    outcome: str
    detail: str
    constructs: frozenset[str]
    transforms: tuple[str, ...]
    policy: str
    precision: str
    random: bool
    seconds: float


def execute(program: Program) -> tuple[str, str]:
    """The harness's verdict on `program`, its source exec'd under a name that tracebacks show."""
    filename = f"<differential seed {program.seed}>"
    linecache.cache[filename] = (len(program.source), None, program.source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"differential_{program.seed}"}
    exec(compile(program.source, filename, "exec"), namespace)  # noqa: S102 - the program is source by design
    return harness.check(namespace["make_program"], namespace["CONSTRUCTS"], namespace["EXACT"])


def run_seed(seed: int, off: frozenset[str] = frozenset()) -> Result:
    start = time.perf_counter()
    program = generate(seed, off)
    try:
        outcome, detail = execute(program)
    finally:
        linecache.cache.pop(f"<differential seed {seed}>", None)
    seconds = time.perf_counter() - start
    return Result(
        seed,
        outcome,
        detail,
        program.constructs,
        program.transforms,
        program.policy,
        program.precision,
        program.random,
        seconds,
    )


def shrink(seed: int) -> Result:
    """The failing seed's program with every construct turned off that it fails as before
    without (the same failure_kind; one at a time, greedily), then the policy replaced by
    None and the precision by float64 where that still fails so."""
    result = run_seed(seed)
    if result.outcome in harness.ACCEPTABLE:
        return result
    kind = failure_kind(result.detail)
    off: frozenset[str] = frozenset()
    knobs = ["policy", "call_pattern"] + (["precision"] if result.precision != "float64" else [])
    for construct in sorted(result.constructs, key=lambda c: c in REQUIRES.values()) + knobs:
        trial = run_seed(seed, off | {construct})
        if trial.outcome not in harness.ACCEPTABLE and failure_kind(trial.detail) == kind:
            off, result = off | {construct}, trial
    return result


def save_repro(program: Program, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / REPRO_NAME.format(seed=program.seed)
    path.write_text(program.standalone())
    return path


def failure_kind(detail: str) -> str:
    """A failure's detail without its numbers and call: what differs, or what was raised."""
    if " raised " in detail or detail.startswith(("refused", "RematStateWarning")):
        head = re.sub(r"`[^`]*`|\([^)]*\)|\d+", "_", detail)
        head, _, cause = head.partition("torch could not run an op of the graph remat traced: ")
        return (f"refused under a transform: {cause}" if cause else head)[:110]
    rest = detail.partition(": ")[2]
    where = re.sub(r"\[\d+\]", "", rest.split(": ")[0])
    if "not a plain torch.Tensor" in rest:
        return f"{where}: not a plain tensor"
    if "items, remat" in rest:
        return f"{where}: number of records"
    if "eager None" in rest or "remat None" in rest:
        return f"{where}: None against a tensor"
    return f"{where}: values"


def survey(seeds: Iterable[int], report: Callable[[str], None] = print) -> list[Result]:
    """Runs the seeds; prints outcome counts and the failures grouped by what differs and
    the constructs they shrink to, with their transforms and an example seed."""
    results = [run_seed(s) for s in seeds]
    counts = Counter(r.outcome for r in results).most_common()
    seconds = sum(r.seconds for r in results)
    report(f"{len(results)} programs in {seconds:.1f} s: " + ", ".join(f"{k} {v}" for k, v in counts))
    groups: dict[tuple[str, tuple[str, ...]], list[Result]] = {}
    for r in results:
        if r.outcome == "fail":
            small = shrink(r.seed)
            features = tuple(sorted(small.constructs)) + (("random draws",) if small.random else ())
            features += (small.policy.split("(")[0],) if small.policy != "None" else ()
            features += (small.precision,) if small.precision != "float64" else ()
            groups.setdefault((failure_kind(small.detail), features), []).append(small)
    for (kind, constructs), members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        transforms = sorted({t for m in members for t in m.transforms})
        seeds = " ".join(str(m.seed) for m in members[:4])
        report(f"{len(members):4d}  [{' '.join(constructs) or '-'}] {kind}  ({' '.join(transforms)}; seeds {seeds})")
    return results


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--seed", type=int, help="print seed N's program as a standalone file")
    group.add_argument("--run", type=int, help="run seed N and print its outcome")
    group.add_argument("--shrink", type=int, help="run seed N with the fewest constructs that still fail")
    group.add_argument("--survey", type=int, nargs=2, metavar=("START", "COUNT"), help="run COUNT seeds from START")
    args = parser.parse_args()
    if args.seed is not None:
        print(generate(args.seed).standalone(), end="")
    elif args.survey is not None:
        survey(range(args.survey[0], args.survey[0] + args.survey[1]))
    else:
        r = run_seed(args.run) if args.run is not None else shrink(args.shrink)
        print(
            f"seed {r.seed}: {r.outcome} ({r.seconds:.2f} s) constructs {sorted(r.constructs)}"
            f"{' (random draws)' if r.random else ''} transforms {list(r.transforms)} policy {r.policy} {r.precision}"
        )
        if r.detail:
            print(f"  {r.detail}")


if __name__ == "__main__":
    _main()
